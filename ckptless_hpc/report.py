"""``ckptless-hpc report``: what a run (or a sweep of runs) did and what its failures cost.

Text: one summary per run (recoveries with their phases, downtime, goodput, lost and redone
steps), or one comparison table for several runs. Chart (PNG, matplotlib's Agg backend, imported
only when a chart is drawn): loss and throughput over training time with every failure and
recovery phase marked, plus a zoomed timeline of each recovery, whose phases are far too short to
read on the run's own time axis.

The numbers printed are the ones in summary.json (same values, same rounding), so the report
never disagrees with the file a script would read.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .rundir import PHASES, RecoveryView, Run, global_batch, progress, recoveries, requeues, step_series

PHASE_COLORS = {"detect": "#d62728", "reconfigure": "#ff7f0e", "transfer": "#1f77b4", "resume": "#2ca02c"}
PHASE_MEANING = {
    "detect": "failure -> noticed",
    "reconfigure": "new generation, survivors hold, spare promoted, group re-formed",
    "transfer": "state streamed peer-to-peer to the spare",
    "resume": "re-formed -> first step committed again",
}


# ------------------------------------------------------------------------------ text
def _s(x: Optional[float]) -> str:
    """Seconds as summary.json rounds them (4 decimals), trailing zeros kept for alignment."""
    return "-" if x is None else f"{x:.4f}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run_text(run: Run, now: float) -> str:
    """The text summary of one run (finished: from summary.json; running: from its events)."""
    s = run.summary
    recs = recoveries(run)
    lines: List[str] = []
    if s is None:
        total = (run.config or {}).get("train", {}).get("steps")
        p = progress(run.current, total, now)
        lines += [
            f"run {run.path}  (job {_job(run)}: no summary.json yet — {p.phase}, report from events so far)",
            f"  steps           {p.step}/{total if total is not None else '?'}   last loss {_loss(p.loss)}",
            f"  generation      {p.gen}   workers alive {p.workers_alive}   spares ready {p.spares_ready}",
        ]
    else:
        lines += [
            f"run {run.path}  (job {s['job']}: {s['status']}, exit {s['exit_code']})",
            f"  steps           {s['steps_completed']}/{s['steps_requested']}   final loss {_loss(s.get('final_loss'))}",
            f"  wall            {_s(s['wall_s'])} s of training after {_s(s['startup_s'])} s start-up",
            f"  goodput         {100 * s['goodput']:.2f}%  (productive {_s(s['productive_s'])} s / wall {_s(s['wall_s'])} s)",
            f"  world           {s['world_size']} ranks, {s['generations']} generation(s); excluded nodes: {', '.join(s['excluded_nodes']) or 'none'}",
            f"  final state     sha256 {s['final_state_sha256']}",
        ]
        if s.get("error"):
            lines.append("  error           " + str(s["error"]).replace("\n", "\n                  "))
        if s.get("saved_state"):
            lines.append(f"  saved state     {s['saved_state'].get('path')} (step {s['saved_state'].get('step')})")
    for q in requeues(run.events):
        lines.append(f"  requeued        after {q.reason.splitlines()[0][:120]}; restarted {q.t_restart - q.t_end:.1f} s later at step {q.step}")
    if len(run.attempts) > 1 and s is not None:
        lines.append(f"  (wall, goodput and the summary numbers are those of the last of {len(run.attempts)} attempts)")
    total_down = sum(r.downtime_s for r in recs)
    lines.append(f"  recoveries      {len(recs)}" + (f", total downtime {_s(total_down)} s" if recs else ""))
    for r in recs:
        lines += recovery_lines(r)
    return "\n".join(lines)


def recovery_lines(r: RecoveryView) -> List[str]:
    swaps = ", ".join(f"rank {k} -> {v}" for k, v in sorted(r.replacements.items(), key=lambda kv: int(kv[0]))) or "none"
    redone = _steps_text(r.redone_steps)
    return [
        f"  #{r.index} generation {r.gen}: {r.cause()}",
        f"      failed      ranks {r.failed_ranks} on {', '.join(r.failed_nodes)} ({', '.join(r.failed_workers)}); replaced: {swaps}",
        f"      downtime    {_s(r.downtime_s)} s = detect {_s(r.detect_s)} + reconfigure {_s(r.reconfigure_s)}"
        f" + transfer {_s(r.transfer_s)} + resume {_s(r.resume_s)}",
        f"      lost work   resumed from committed step {r.target_step}; {r.rolled_back} committed step(s) rolled back;"
        f" redone: {redone}",
        f"      state       {_mb(r.bytes_transferred)} moved peer-to-peer ({r.bytes_transferred} bytes); survivors restarted {r.survivors_restarted}",
    ]


def _steps_text(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    if len(steps) == 1:
        return f"step {steps[0]} (in flight)"
    return f"steps {steps[0]}-{steps[-1]} ({len(steps) - 1} rolled back + 1 in flight)"


def _loss(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def _job(run: Run) -> str:
    return str(run.started.get("job", "?"))


# ------------------------------------------------------------------------------ sweep table
TABLE_COLUMNS = (
    "run", "status", "steps", "wall_s", "goodput", "recoveries", "downtime_s",
    "detect_s", "reconfigure_s", "transfer_s", "resume_s", "MB_moved", "state",
)


def varying_overrides(runs: Sequence[Run]) -> List[str]:
    """Labels for the runs: the overrides that are not the same in all of them."""
    common = set(runs[0].overrides).intersection(*[set(r.overrides) for r in runs[1:]]) if runs else set()
    labels = []
    for r in runs:
        own = [o for o in r.overrides if o not in common]
        labels.append(" ".join(own) or r.name)
    return labels


def table_rows(runs: Sequence[Run]) -> List[Dict[str, Any]]:
    rows = []
    for run, label in zip(runs, varying_overrides(runs)):
        s = run.summary or {}
        recs = recoveries(run)
        row: Dict[str, Any] = {"run": label, "path": run.path}
        row["status"] = s.get("status", "running?")
        row["steps"] = f"{s['steps_completed']}/{s['steps_requested']}" if s else "-"
        row["wall_s"] = s.get("wall_s")
        row["goodput"] = s.get("goodput")
        row["recoveries"] = len(recs)
        row["downtime_s"] = round(sum(r.downtime_s for r in recs), 4)
        for ph in PHASES:
            row[f"{ph}_s"] = round(sum(getattr(r, f"{ph}_s") for r in recs), 4)
        row["MB_moved"] = round(sum(r.bytes_transferred for r in recs) / 1e6, 1)
        sha = s.get("final_state_sha256")
        row["state"] = sha[:12] if sha else "-"
        rows.append(row)
    return rows


def sweep_text(runs: Sequence[Run]) -> str:
    """One comparison table (times summed over each run's recoveries) plus a legend."""
    rows = table_rows(runs)
    cells = [list(TABLE_COLUMNS)]
    for row in rows:
        cells.append([_cell(c, row[c]) for c in TABLE_COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(TABLE_COLUMNS))]
    out = []
    for k, r in enumerate(cells):
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    out.append("")
    out.append("downtime_s and its phases are summed over each run's recoveries; goodput = productive step time / wall time after start-up;")
    out.append("state = first 12 hex digits of final_state_sha256 (equal for runs of one config with and without faults).")
    groups: Dict[str, List[str]] = {}
    for row in rows:
        if row["state"] != "-":
            groups.setdefault(row["state"], []).append(row["run"])
    same = [v for v in groups.values() if len(v) > 1]
    for g in same:
        out.append(f"same final state: {', '.join(g)}")
    for row in rows:
        out.append(f"{row['run']}: {row['path']}")
    return "\n".join(out)


def _cell(col: str, v: Any) -> str:
    if v is None:
        return "-"
    if col == "goodput":
        return f"{100 * v:.2f}%"
    if col.endswith("_s"):
        return f"{v:.4f}"
    return str(v)


# ------------------------------------------------------------------------------ chart data (pure)
def throughput(t: Sequence[float], steps_window: int = 5) -> Tuple[List[float], List[float], List[float]]:
    """(times, raw steps/s, smoothed steps/s) from the arrival times of consecutive steps.

    Raw: 1 / (time since the previous step): one long interval (a recovery) shows as a deep
    notch. Smoothed: steps per second over the last ``steps_window`` intervals.
    """
    times, raw, smooth = [], [], []
    for i in range(1, len(t)):
        dt = t[i] - t[i - 1]
        times.append(t[i])
        raw.append(1.0 / dt if dt > 0 else float("nan"))
        j = max(0, i - steps_window)
        span = t[i] - t[j]
        smooth.append((i - j) / span if span > 0 else float("nan"))
    return times, raw, smooth


def moving_average(xs: Sequence[float], window: int) -> List[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


# ------------------------------------------------------------------------------ charts
def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ChartUnavailable(
            "matplotlib is not installed, so no chart can be drawn. HINT: pip install 'ckptless_hpc[report]' "
            "(or pass --no-chart for the text alone)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


class ChartUnavailable(RuntimeError):
    """The chart cannot be drawn here (matplotlib missing)."""


def run_chart(run: Run, out_png: str) -> str:
    """Draw one run's chart to ``out_png``; returns the path."""
    plt = _plt()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ser = step_series(run.events)
    recs = recoveries(run)
    n_rec = len(recs)
    if recs:
        fig = plt.figure(figsize=(13, 8.5 + 0.55 * (n_rec - 1)), dpi=110)
        gs = fig.add_gridspec(3, 1, height_ratios=[3.0, 2.0, 1.0 + 0.45 * n_rec], hspace=0.42)
        ax_rec = fig.add_subplot(gs[2])
    else:
        fig = plt.figure(figsize=(13, 6.5), dpi=110)
        gs = fig.add_gridspec(2, 1, height_ratios=[3.0, 2.0], hspace=0.3)
        ax_rec = None
    ax_loss = fig.add_subplot(gs[0])
    ax_tp = fig.add_subplot(gs[1], sharex=ax_loss)

    # ---- loss and throughput, one line segment per attempt (never across a requeue gap)
    win = max(1, len(ser.loss) // 40)
    for k, seg in enumerate(ser.segments()):
        first = k == 0
        ax_loss.plot(seg.t, seg.loss, color="#9bbbd9", lw=0.8, label="loss (each step, mean over ranks)" if first else None)
        if win > 1:
            ax_loss.plot(seg.t, moving_average(seg.loss, win), color="#1f4e79", lw=2, label=f"loss ({win}-step moving average)" if first else None)
        tt, raw, smooth = throughput(seg.t)
        ax_tp.plot(tt, raw, color="#c7c7c7", lw=0.8, label="steps/s (1 / time since previous step)" if first else None)
        ax_tp.plot(tt, smooth, color="#333333", lw=1.8, label="steps/s (over the last 5 steps)" if first else None)
    ax_loss.set_ylabel("training loss")
    ax_loss.grid(alpha=0.3)
    ax_tp.set_ylabel("throughput (steps/s)")
    ax_tp.set_xlabel("training time (s since the first generation started)")
    ax_tp.set_ylim(bottom=0)
    ax_tp.grid(alpha=0.3)
    gb = global_batch(run)
    if gb:
        sec = ax_tp.secondary_yaxis("right", functions=(lambda x, g=gb: x * g, lambda x, g=gb: x / g))
        sec.set_ylabel(f"samples/s ({gb} samples per step)")
    plt.setp(ax_loss.get_xticklabels(), visible=True)

    # ---- failures and recovery phases on both time axes
    for r in recs:
        for ax in (ax_loss, ax_tp):
            for name, start, dur in r.phases:
                ax.axvspan(start - ser.t0, start - ser.t0 + dur, color=PHASE_COLORS[name], alpha=0.35, lw=0)
            ax.axvline(r.t_fail - ser.t0, color="#d62728", ls="--", lw=1.2)
        ax_loss.annotate(
            f"#{r.index} {_short_cause(r)}\n{1e3 * r.downtime_s:.0f} ms down",
            xy=(r.t_fail - ser.t0, 1.0), xycoords=("data", "axes fraction"), xytext=(4, -4), textcoords="offset points",
            ha="left", va="top", fontsize=9, color="#a00000",
            bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="#d62728", alpha=0.9),
        )
    for q in requeues(run.events):
        for ax in (ax_loss, ax_tp):
            ax.axvspan(q.t_end - ser.t0, q.t_restart - ser.t0, color="#7f7f7f", alpha=0.25, lw=0, hatch="//")
        ax_loss.annotate(
            f"requeued: {q.t_restart - q.t_end:.0f} s\nresumed at step {q.step}", xy=((q.t_end + q.t_restart) / 2 - ser.t0, 0.5),
            xycoords=("data", "axes fraction"), ha="center", va="center", fontsize=9, color="#333333",
            bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="#7f7f7f", alpha=0.9),
        )
    handles = ax_loss.get_legend_handles_labels()[0]
    if recs:
        handles.append(Line2D([], [], color="#d62728", ls="--", lw=1.2, label="failure (fault injected or detected)"))
    ax_loss.legend(handles=handles, loc="upper right", fontsize=9, framealpha=0.9)
    ax_tp.legend(loc="best", fontsize=9, framealpha=0.9)

    # ---- zoomed recovery timelines
    if ax_rec is not None:
        _recovery_gantt(ax_rec, recs)
    fig.suptitle(_title(run), fontsize=12, x=0.01, ha="left")
    fig.text(0.01, 0.935, _subtitle(run), fontsize=9.5, ha="left", color="#444444")
    bottom = 0.06
    if recs:
        fig.legend(
            handles=[Patch(color=PHASE_COLORS[p], alpha=0.8, label=f"{p}: {PHASE_MEANING[p]}") for p in PHASES],
            loc="lower center", ncol=2, fontsize=9, frameon=False, title="recovery phases (shaded on the time axes above)", title_fontsize=9,
        )
        bottom = 0.15
    fig.subplots_adjust(left=0.07, right=0.92, top=0.9 if recs else 0.87, bottom=bottom if recs else 0.09)
    _save(fig, out_png)
    plt.close(fig)
    return out_png


def _recovery_gantt(ax: Any, recs: Sequence[RecoveryView]) -> None:
    if not recs:
        ax.axis("off")
        ax.text(0.5, 0.5, "no failures: nothing to recover from", ha="center", va="center", fontsize=11, transform=ax.transAxes)
        return
    longest = max(1e3 * r.downtime_s for r in recs) or 1.0
    for i, r in enumerate(recs):
        y = len(recs) - 1 - i
        for name, start, dur in r.phases:
            x0, w = 1e3 * (start - r.t_fail), 1e3 * dur
            ax.barh(y, w, left=x0, color=PHASE_COLORS[name], height=0.6, edgecolor="white")
            if w > longest * 0.1:  # the phase's name and value inside its bar, where they fit
                ax.text(x0 + w / 2, y, f"{name}\n{w:.0f} ms", ha="center", va="center", fontsize=8, color="white", weight="bold")
        ax.text(1e3 * r.downtime_s, y, f"  {1e3 * r.downtime_s:.0f} ms down\n  {_short_cause(r)}", va="center", fontsize=8.5)
    ax.set_xlim(0, longest * 1.35)
    ax.set_ylim(-0.6, len(recs) - 0.4)
    ax.set_yticks(range(len(recs)))
    ax.set_yticklabels([f"#{r.index}\ngen {r.gen}" for r in reversed(recs)], fontsize=8.5)
    ax.set_xlabel("ms since the failure (each recovery zoomed in: downtime = detect + reconfigure + transfer + resume)")
    ax.set_title("recoveries, zoomed in", fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _short_cause(r: RecoveryView) -> str:
    if r.fault is not None:
        f = r.fault
        who = f"node slot {f.get('node')}" if f.get("kind") == "kill_node" else f"rank {f.get('rank')}"
        return f"{f.get('kind')} {who} @ step {f.get('step')}"
    return f"ranks {r.failed_ranks} failed"


def _title(run: Run) -> str:
    s = run.summary
    if s is None:
        return f"ckptless_hpc run {run.path} (job {_job(run)}, still running or ended without a summary)"
    return f"ckptless_hpc run {run.path}: {s['status']}, {s['steps_completed']}/{s['steps_requested']} steps, job {s['job']}"


def _subtitle(run: Run) -> str:
    s = run.summary
    recs = recoveries(run)
    down = sum(r.downtime_s for r in recs)
    parts = [f"{len(recs)} recover{'y' if len(recs) == 1 else 'ies'}, downtime {down:.3f} s in total"]
    qs = requeues(run.events)
    if qs:
        parts.append(f"{len(qs)} requeue(s), {sum(q.t_restart - q.t_end for q in qs):.1f} s off")
    if s is not None:
        parts += [f"goodput {100 * s['goodput']:.2f}%", f"{s['wall_s']:.2f} s training after {s['startup_s']:.2f} s start-up", f"world size {s['world_size']}"]
    if run.overrides:
        parts.append(" ".join(run.overrides))
    return "   |   ".join(parts)


def sweep_chart(runs: Sequence[Run], out_png: str) -> str:
    """Several runs side by side: loss over training time, and each run's downtime by phase."""
    plt = _plt()
    from matplotlib.patches import Patch

    labels = varying_overrides(runs)
    fig, (ax_l, ax_d) = plt.subplots(1, 2, figsize=(14, 4.5 + 0.35 * len(runs)), dpi=110, gridspec_kw=dict(width_ratios=[1.4, 1]))
    cmap = plt.get_cmap("tab10")
    for i, (run, label) in enumerate(zip(runs, labels)):
        ser = step_series(run.events)
        color = cmap(i % 10)
        for k, seg in enumerate(ser.segments()):
            ax_l.plot(seg.t, moving_average(seg.loss, max(1, len(ser.loss) // 40)), color=color, lw=1.6, label=label if k == 0 else None)
        for r in recoveries(run):
            ax_l.axvline(r.t_fail - ser.t0, color=color, ls="--", lw=1)
    ax_l.set_xlabel("training time (s); dashed: failures")
    ax_l.set_ylabel("training loss (moving average)")
    ax_l.grid(alpha=0.3)
    ax_l.legend(fontsize=8.5)
    ys = list(range(len(runs)))[::-1]
    for y, run in zip(ys, runs):
        left = 0.0
        for ph in PHASES:
            v = 1e3 * sum(getattr(r, f"{ph}_s") for r in recoveries(run))
            ax_d.barh(y, v, left=left, color=PHASE_COLORS[ph], height=0.6)
            left += v
        s = run.summary or {}
        gp = f"goodput {100 * s['goodput']:.1f}%" if s.get("goodput") is not None else "running"
        ax_d.text(left, y, f"  {left:.0f} ms, {gp}", va="center", fontsize=8.5)
    ax_d.set_yticks(ys)
    ax_d.set_yticklabels(labels, fontsize=8.5)
    ax_d.set_xlabel("total downtime (ms), by recovery phase")
    xmax = max([sum(r.downtime_s for r in recoveries(run)) for run in runs] + [1e-3]) * 1e3
    ax_d.set_xlim(0, xmax * 1.6)
    ax_d.grid(axis="x", alpha=0.3)
    ax_d.legend(handles=[Patch(color=PHASE_COLORS[p], label=p) for p in PHASES], fontsize=8.5, loc="lower right")
    fig.suptitle(f"ckptless_hpc sweep: {len(runs)} runs", x=0.01, ha="left")
    fig.tight_layout()
    _save(fig, out_png)
    plt.close(fig)
    return out_png


def _save(fig: Any, out_png: str) -> None:
    parent = os.path.dirname(os.path.abspath(out_png))
    os.makedirs(parent, exist_ok=True)
    tmp = out_png + ".tmp.png"
    fig.savefig(tmp)
    os.replace(tmp, out_png)
