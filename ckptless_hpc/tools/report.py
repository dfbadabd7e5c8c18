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

from ..rundir.read import PHASES, RecoveryView, Run, degraded, evaluations, global_batch, incidents, progress, recoveries, requeues, step_series

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
            lines.append("  error           " + str(s["error"]).strip().replace("\n", "\n                  "))
        if s.get("saved_state"):
            lines.append(f"  saved state     {s['saved_state'].get('path')} (step {s['saved_state'].get('step')})")
    lines += metric_lines(run)
    for q in requeues(run.events):
        lines.append(f"  requeued        after {q.reason.splitlines()[0][:120]}; restarted {q.t_restart - q.t_end:.1f} s later at step {q.step}")
    if len(run.attempts) > 1 and s is not None:
        lines.append(f"  (wall, goodput and the summary numbers are those of the last of {len(run.attempts)} attempts)")
    total_down = sum(r.downtime_s for r in recs)
    lines.append(f"  recoveries      {len(recs)}" + (f", total downtime {_s(total_down)} s" if recs else ""))
    for r in recs:
        lines += recovery_lines(r)
    moved = run.of("moved")  # planned moves (drains, stragglers replaced, grow-backs): no failure, no step redone
    if moved:
        lines.append(f"  planned moves   {len(moved)}, total downtime {_s(sum(float(e.get('downtime_s') or 0.0) for e in moved))} s")
        lines += [
            f"      {e.get('kind')} of node(s) {', '.join(e.get('nodes') or []) or '-'} (rank(s) {e.get('ranks')}) at step {e.get('planned_step')}: downtime {_s(e.get('downtime_s'))} s; {e.get('reason')}"
            for e in moved
        ]
    shrunk = degraded(run.events)
    if shrunk is not None:
        lines.append(f"  degraded        {_s(shrunk['seconds'])} s with fewer processes than ranks (cluster.min_nodes):")
        lines += [f"      steps {d['from_step']}-{d['to_step']} on {d['processes']} processes, {_s(d['seconds'])} s" for d in shrunk["spans"]]
    t0 = step_series(run.events).t0
    for f in unrecovered_failures(run, recs):
        lines.append(f"  not recovered   t={float(f['time']) - t0:.2f} s: rank {f.get('rank')} ({f.get('worker')} on {f.get('node')}) failed: {f.get('reason')}")
    for inc in incidents(run.events):
        lines.append(f"  {inc.kind:<15} t={inc.t - t0:.2f} s: {inc.text}")
    return "\n".join(lines)


def _values(metrics: Dict[str, Any]) -> str:
    return "  ".join(f"{k} {_loss(v)}" for k, v in sorted(metrics.items()))


def metric_lines(run: Run) -> List[str]:
    """The evaluation panel (each evaluation's step, the last one's values) and the task's own
    metrics of the last step: from the events, so a running job shows them too."""
    lines = []
    evals = evaluations(run.events)
    if evals:
        last = evals[max(evals)]
        lines.append(f"  evaluations     {len(evals)}, at step(s) {', '.join(map(str, sorted(evals)))}; last (step {last['step']}): {_values(last['metrics'])}")
    own = next((e["metrics"] for e in reversed(run.events) if e.get("event") == "step" and e.get("metrics")), None)
    if own:
        lines.append(f"  own metrics     last step: {_values(own)}")
    return lines


def recovery_lines(r: RecoveryView) -> List[str]:
    swaps = ", ".join(f"rank {k} -> {v}" for k, v in sorted(r.replacements.items(), key=lambda kv: int(kv[0]))) or "none"
    redone = _steps_text(r.redone_steps)
    return [
        f"  #{r.index} generation {r.gen}: {r.cause()}",
        f"      failed      ranks {r.failed_ranks} on {', '.join(r.failed_nodes)} ({', '.join(r.failed_workers)}); replaced: {swaps}",
        f"      downtime    {_s(r.downtime_s)} s = detect {_s(r.detect_s)} + reconfigure {_s(r.reconfigure_s)} + transfer {_s(r.transfer_s)} + resume {_s(r.resume_s)}",
        f"      lost work   resumed from committed step {r.target_step}; {r.rolled_back} committed step(s) rolled back; redone: {redone}",
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


def unrecovered_failures(run: Run, recs: Sequence[RecoveryView]) -> List[Dict[str, Any]]:
    """failure_detected events of ranks (not spares) that no completed recovery covers."""
    covered = {(r.gen, w) for r in recs for w in r.failed_workers}
    out = []
    for att in run.attempts:
        gens = sorted({r.gen for r in recs})
        for e in att:
            if e.get("event") != "failure_detected" or e.get("role") != "active":
                continue
            nxt = next((g for g in gens if g > (e.get("gen") or 0)), None)
            if nxt is None or (nxt, e.get("worker")) not in covered:
                out.append(e)
    return out


# ------------------------------------------------------------------------------ sweep table
TABLE_COLUMNS = (
    "run",
    "status",
    "steps",
    "wall_s",
    "goodput",
    "recoveries",
    "downtime_s",
    "detect_s",
    "reconfigure_s",
    "transfer_s",
    "resume_s",
    "MB_moved",
    "state",
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
        row: Dict[str, Any] = {"run": _clip(label, 48), "label": label, "path": run.path}
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
        out.append(f"{row['label']}: {row['path']}")
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
def throughput(t: Sequence[float], short: int = 3, long: int = 10) -> Tuple[List[float], List[float], List[float]]:
    """(times, steps/s over the last ``short`` steps, steps/s over the last ``long`` steps).

    Rates over a few steps, not 1 / one interval: step events are stamped when the coordinator
    receives them, and a burst of queued messages would otherwise read as thousands of steps/s.
    A recovery (one long interval) still shows as a notch.
    """
    times: List[float] = []
    fast: List[float] = []
    slow: List[float] = []
    for i in range(1, len(t)):
        times.append(t[i])
        for k, out in ((short, fast), (long, slow)):
            j = max(0, i - k)
            span = t[i] - t[j]
            out.append((i - j) / span if span > 0 else float("nan"))
    return times, fast, slow


def robust_top(values: Sequence[float], q: float = 0.98, headroom: float = 1.3) -> Optional[float]:
    """An axis limit that ignores rare spikes: the q-quantile times ``headroom``."""
    vals = sorted(v for v in values if v == v)  # drop NaN
    if not vals:
        return None
    return vals[min(len(vals) - 1, int(q * len(vals)))] * headroom


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
        raise ChartUnavailable("matplotlib is not installed, so no chart can be drawn. HINT: pip install 'ckptless_hpc[report]' (or pass --no-chart for the text alone)") from None
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
    tops: List[Optional[float]] = []
    for k, seg in enumerate(ser.segments()):
        first = k == 0
        ax_loss.plot(seg.t, seg.loss, color="#9bbbd9", lw=0.8, label="loss (each step, mean over ranks)" if first else None)
        if win > 1:
            ax_loss.plot(seg.t, moving_average(seg.loss, win), color="#1f4e79", lw=2, label=f"loss ({win}-step moving average)" if first else None)
        tt, fast, slow = throughput(seg.t)
        ax_tp.plot(tt, fast, color="#b0b0b0", lw=0.8, label="steps/s (over the last 3 steps)" if first else None)
        ax_tp.plot(tt, slow, color="#333333", lw=1.8, label="steps/s (over the last 10 steps)" if first else None)
        tops.append(robust_top(slow, headroom=1.6))
    evals = [e for _, e in sorted(evaluations(run.events).items()) if isinstance(e["metrics"].get("loss"), (int, float))]
    if evals:  # the task's evaluate() returns a "loss": its points on the same axis
        ax_loss.plot([float(e["time"]) - ser.t0 for e in evals], [e["metrics"]["loss"] for e in evals], "o", color="#c0504d", ms=5, label="evaluation loss")
    ax_loss.set_ylabel("training loss")
    ax_loss.grid(alpha=0.3)
    ax_tp.set_ylabel("throughput (steps/s)")
    ax_tp.set_xlabel("training time (s since the first generation started)")
    top = max([x for x in tops if x], default=None)
    ax_tp.set_ylim(0, top) if top else ax_tp.set_ylim(bottom=0)
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
            xy=(r.t_fail - ser.t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -4),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=9,
            color="#a00000",
            bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="#d62728", alpha=0.9),
        )
    for q in requeues(run.events):
        for ax in (ax_loss, ax_tp):
            ax.axvspan(q.t_end - ser.t0, q.t_restart - ser.t0, color="#7f7f7f", alpha=0.25, lw=0, hatch="//")
        ax_loss.annotate(
            f"requeued: {q.t_restart - q.t_end:.0f} s\nresumed at step {q.step}",
            xy=((q.t_end + q.t_restart) / 2 - ser.t0, 0.5),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="center",
            fontsize=9,
            color="#333333",
            bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="#7f7f7f", alpha=0.9),
        )
    t_last = max([ser.t[-1] if ser.t else 0.0] + [r.t_resumed - ser.t0 for r in recs])
    unrecovered: List[Tuple[float, str]] = []
    for f in unrecovered_failures(run, recs):
        x = float(f["time"]) - ser.t0
        t_last = max(t_last, x)
        for ax in (ax_loss, ax_tp):
            ax.axvline(x, color="#d62728", ls="--", lw=1.2)
        unrecovered.append((x, f"rank {f.get('rank')} ({f.get('worker')}) failed:\n{str(f.get('reason'))[:60]}\nnot recovered"))
    end = next((e for e in reversed(run.events) if e.get("event") == "job_finished"), None)
    if end is not None and end.get("status") != "completed":
        x = float(end["time"]) - ser.t0
        t_last = max(t_last, x)
        for ax in (ax_loss, ax_tp):
            ax.axvline(x, color="black", lw=1.5)
        ax_loss.annotate(
            f"job ended:\n{end.get('status')} (exit {end.get('exit_code')})",
            xy=(x, 0.3),
            xycoords=("data", "axes fraction"),
            xytext=(-4, 0),
            textcoords="offset points",
            ha="right",
            va="top",
            fontsize=8.5,
            bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="black", alpha=0.9),
        )
    ax_loss.set_xlim(-0.02 * max(t_last, 1e-3), 1.03 * max(t_last, 1e-3))
    for x, label in unrecovered:  # labels on the side of the line where there is room
        right = x > 0.6 * t_last
        ax_loss.annotate(
            label,
            xy=(x, 0.62),
            xycoords=("data", "axes fraction"),
            xytext=(-4 if right else 4, 0),
            textcoords="offset points",
            ha="right" if right else "left",
            va="top",
            fontsize=8.5,
            color="#a00000",
            bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="#d62728", alpha=0.9),
        )
    slow_drawn = False
    for inc in incidents(run.events):
        if inc.kind == "straggler":
            end = inc.t_end if inc.t_end is not None else ser.t0 + (ser.t[-1] if ser.t else 0.0)
            ax_tp.axvspan(inc.t - ser.t0, end - ser.t0, color="#bcbd22", alpha=0.25, lw=0, label=None if slow_drawn else "straggler reported")
            slow_drawn = True
        else:
            ax_tp.axvline(inc.t - ser.t0, color="#9467bd", ls=":", lw=1.2)
            ax_tp.annotate(
                inc.kind.replace("_", " "), xy=(inc.t - ser.t0, 0.97), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8, color="#9467bd"
            )
    handles = ax_loss.get_legend_handles_labels()[0]
    if not ser.t:
        ax_loss.text(0.5, 0.5, "no training step was reported", ha="center", va="center", transform=ax_loss.transAxes, fontsize=11)
    if recs:
        handles.append(Line2D([], [], color="#d62728", ls="--", lw=1.2, label="failure (fault injected or detected)"))
    if handles:
        ax_loss.legend(handles=handles, loc="upper right", fontsize=9, framealpha=0.9)
    if ax_tp.get_legend_handles_labels()[0]:
        ax_tp.legend(loc="best", fontsize=9, framealpha=0.9)

    # ---- zoomed recovery timelines
    if ax_rec is not None:
        _recovery_gantt(ax_rec, recs)
    fig.suptitle(_title(run), fontsize=12, x=0.01, ha="left")
    fig.text(0.01, 0.945, _subtitle(run), fontsize=9.5, ha="left", va="top", color="#444444", linespacing=1.5)
    bottom = 0.06
    if recs:
        fig.legend(
            handles=[Patch(color=PHASE_COLORS[p], alpha=0.8, label=f"{p}: {PHASE_MEANING[p]}") for p in PHASES],
            loc="lower center",
            ncol=2,
            fontsize=9,
            frameon=False,
            title="recovery phases (shaded on the time axes above)",
            title_fontsize=9,
        )
        bottom = 0.15
    top = (0.9 if recs else 0.87) - (0.02 if run.overrides else 0.0)
    fig.subplots_adjust(left=0.07, right=0.92, top=top, bottom=bottom if recs else 0.09)
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
        at = f.get("at") or "step"
        return f"{f.get('kind')} {who} @ step {f.get('step')}" + ("" if at == "step" else f" ({at})")
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
    text = "   |   ".join(parts)
    if run.overrides:
        ov = " ".join(run.overrides)
        text += "\noverrides: " + (ov if len(ov) <= 170 else ov[:167] + "...")
    return text


def sweep_chart(runs: Sequence[Run], out_png: str) -> str:
    """Several runs side by side: downtime by phase, goodput, and loss by step."""
    plt = _plt()
    from matplotlib.patches import Patch

    labels = varying_overrides(runs)
    ids = [f"#{i + 1}" for i in range(len(runs))]
    n = len(runs)
    key_lines = [f"{i}  {_clip(label, 150)}   ({run.path})" for i, label, run in zip(ids, labels, runs)]
    fig_h = 4.6 + 0.32 * n + 0.2 * n
    fig = plt.figure(figsize=(15, fig_h), dpi=110)
    gs = fig.add_gridspec(1, 3, width_ratios=[1.25, 0.8, 1.45], wspace=0.35)
    ax_d, ax_g, ax_l = (fig.add_subplot(gs[i]) for i in range(3))
    ys = list(range(n))[::-1]

    # downtime by phase
    downs = []
    for y, run in zip(ys, runs):
        left = 0.0
        for ph in PHASES:
            v = 1e3 * sum(getattr(r, f"{ph}_s") for r in recoveries(run))
            ax_d.barh(y, v, left=left, color=PHASE_COLORS[ph], height=0.6)
            left += v
        downs.append(left)
        nrec = len(recoveries(run))
        ax_d.text(left, y, f"  {left:.0f} ms ({nrec} recover{'y' if nrec == 1 else 'ies'})", va="center", fontsize=8.5)
    ax_d.set_xlim(0, max(downs + [1.0]) * 1.7)
    ax_d.set_yticks(ys)
    ax_d.set_yticklabels(ids)
    ax_d.set_xlabel("downtime (ms, all recoveries), by phase")
    ax_d.grid(axis="x", alpha=0.3)
    ax_d.legend(handles=[Patch(color=PHASE_COLORS[p], label=p) for p in PHASES], fontsize=8, loc="lower right")

    # goodput
    for y, run in zip(ys, runs):
        s = run.summary or {}
        gp = s.get("goodput")
        status = s.get("status", "running?")
        ok = status == "completed"
        ax_g.barh(y, 100 * (gp or 0.0), color="#4c72b0" if ok else "#c44e52", height=0.6)
        ax_g.text(100 * (gp or 0.0), y, f" {100 * gp:.1f}%" if gp is not None else " -", va="center", fontsize=8.5)
        if not ok:
            ax_g.text(2, y, status, va="center", fontsize=8, color="white", weight="bold")
    ax_g.set_xlim(0, 118)
    ax_g.set_yticks(ys)
    ax_g.set_yticklabels(ids)
    ax_g.set_xlabel("goodput (% of wall time in productive steps)")
    ax_g.grid(axis="x", alpha=0.3)

    # loss by step
    cmap = plt.get_cmap("tab10")
    for i, (run, rid) in enumerate(zip(runs, ids)):
        ser = step_series(run.events)
        for k, seg in enumerate(ser.segments()):
            ax_l.plot(seg.step, moving_average(seg.loss, max(1, len(ser.loss) // 40)), color=cmap(i % 10), lw=1.4, alpha=0.85, label=rid if k == 0 else None)
        for r in recoveries(run):
            if r.target_step is not None:
                ax_l.axvline(r.target_step, color=cmap(i % 10), ls="--", lw=0.9)
    ax_l.set_xlabel("step (dashed: where a recovery resumed)")
    ax_l.set_ylabel("training loss (moving average)")
    ax_l.grid(alpha=0.3)
    ax_l.legend(fontsize=8, ncol=2)
    ax_l.set_title("loss by step (runs of one config overlap exactly)", fontsize=9, loc="left")

    fig.suptitle(f"ckptless_hpc: {n} runs compared", x=0.01, ha="left", fontsize=12)
    bottom = (0.55 + 0.2 * n) / fig_h
    fig.text(0.01, bottom - 0.1 / fig_h, "\n".join(key_lines), fontsize=8.5, va="top", ha="left", family="monospace", linespacing=1.4)
    fig.subplots_adjust(left=0.04, right=0.98, top=1 - 0.6 / fig_h, bottom=bottom + 0.55 / fig_h)
    _save(fig, out_png)
    plt.close(fig)
    return out_png


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _save(fig: Any, out_png: str) -> None:
    parent = os.path.dirname(os.path.abspath(out_png))
    os.makedirs(parent, exist_ok=True)
    tmp = out_png + ".tmp.png"
    fig.savefig(tmp)
    os.replace(tmp, out_png)
