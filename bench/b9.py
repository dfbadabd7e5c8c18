"""B9, elastic (``train.reduction=fixed``, ``cluster.min_nodes``): what the fixed-order reduction
costs in steady state, how slow a shrunk job runs, and how long a shrink takes.

- **overhead**: the same job (4 ranks: 2 nodes x 2 workers, no spare) with
  ``train.reduction=fixed`` against ``train.reduction=allreduce``, interleaved back-to-back
  pairs (allreduce, fixed, allreduce, fixed, ...); per pair the ratio of the median wall time
  between committed steps (fixed / allreduce); the overhead is the median of the pair ratios,
  with a verdict against the +10 % target only when every pair agrees (``common.verdict``).
  The ranks' CPU seconds per step (sampled from /proc, as B3 does) are the load-independent
  view. The fixed reduction (train/fixed.py: all-to-all of the partial sums, the owner combines
  in tree order, all-gather) runs after the backward, not overlapped with it as the bucketed
  allreduce is.
- **degraded**: a job of ``nodes`` nodes (one rank each, the fixed reduction,
  ``cluster.min_nodes``, no spare) loses its last node at ``fault.step``; the survivors train
  the lost rank's micro-batches too. The median step interval after the ``shrunk`` event (in
  the generation it started, its first intervals skipped) over the median before it (the
  first generation, warm-up skipped), against the ideal slowdown ``V / live processes`` (V the
  virtual ranks, i.e. the original ranks) and against the bound of this design, the busiest
  process's share ``ceil(V / live)`` (a virtual rank is not split: with 3 ranks on 2 processes
  one process trains 2). The workers' CPU seconds per step after over before is the work view:
  the same global batch, ideally the same CPU (1.0).
- **downtime**: the shrink's recovery (``summary.json`` ``recoveries[0].downtime_s``: the
  fault to the first step committed past it, phases included) against a spare's promotion on
  the same config with ``cluster.spare_nodes=1`` (the same node killed at the same step),
  runs interleaved. Both must end with the ``final_state_sha256`` of the fault-free run of
  that config (``cluster.spare_nodes=1``: the promotion run's own config, and the shrink's
  ``cluster.min_nodes`` and reduction; a spare that is never used changes no bits): ``oracle``.

- **grow back** (the full plan, ``b9_grow_reps``): the first shrink point with a refill allowed,
  for ``parallel=ddp`` and ``zero``: the shrink's downtime (``recoveries[0]``) and the
  grow-back's (``moves[0]``: a planned move at a step boundary, timed from the boundary; the
  refill fetches the state, under ZeRO the lost rank's shard from the survivor that stepped it),
  each with its bytes and net of the first step; the oracle is the fault-free run of that config.

``python -m bench --only b9`` (``--quick`` for the smoke).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from .common import BenchError, cpu_per_step, lm_params, median, spread, task_overrides, verdict

NO_REFILL = ["cluster.refill_spares=false"]  # no spare launched after the loss: the job stays shrunk, the promotion is the only one
TARGET_PCT = 10.0  # the fixed reduction's steady-state overhead over allreduce
PHASES = ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s", "bytes_transferred")


def _worker(cmd: str) -> bool:
    return "ckptless_hpc.worker" in cmd


def _num(x: float) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def _steps(run: Any, gen: int) -> List[Dict[str, Any]]:
    return [e for e in run.of("step") if e.get("gen") == gen and e.get("step") is not None]


def _intervals(steps: List[Dict[str, Any]], skip: int) -> List[float]:
    """Wall time between consecutive committed steps of one generation, the first ``skip`` intervals left out."""
    iv = [b["time"] - a["time"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1]
    return iv[skip:]


def _cpu(run: Any, steps: List[Dict[str, Any]], skip: int) -> Optional[float]:
    """The workers' CPU seconds per step over these steps (None: too short a window to sample)."""
    return _num(cpu_per_step(run.cpu_samples or [], [e["time"] for e in steps], _worker, skip_steps=skip))


# ---------------------------------------------------------------- 1: the fixed reduction's overhead
def overhead(bench: Any) -> Dict[str, Any]:
    p = bench.plan
    base = [*task_overrides(p.b9_size), f"train.steps={p.b9_steps}", "cluster.nodes=2", "cluster.workers_per_node=2", "cluster.spare_nodes=0"]
    runs: Dict[str, List[Any]] = {"allreduce": [], "fixed": []}
    for rep in range(p.b9_reps):  # back to back, alternated: the machine's load drifts
        for red in runs:
            runs[red] = bench.job(f"b9-{red}", base + [f"train.reduction={red}"], rep + 1, sample_cpu=True)
    skip = p.b9_skip
    per = {red: [median(r.step_intervals(skip=skip)) for r in rs] for red, rs in runs.items()}
    in_step = {red: [median(r.step_times(skip=skip)) for r in rs] for red, rs in runs.items()}
    cpu = {red: [_num(cpu_per_step(r.cpu_samples or [], [e["time"] for e in r.of("step")], _worker, skip_steps=skip)) for r in rs] for red, rs in runs.items()}
    ratios = [f / a for a, f in zip(per["allreduce"], per["fixed"])]
    cpu_ratios = [f / a for a, f in zip(cpu["allreduce"], cpu["fixed"]) if a and f]
    out = {
        "size": p.b9_size,
        "params": lm_params(p.b9_size),
        "ranks": 4,
        "layout": "2 nodes x 2 workers, no spare",
        "steps": p.b9_steps,
        "reps": p.b9_reps,
        "allreduce_step_s": median(x for r in runs["allreduce"] for x in r.step_intervals(skip=skip)),
        "fixed_step_s": median(x for r in runs["fixed"] for x in r.step_intervals(skip=skip)),
        "pair_ratios": ratios,
        "overhead_pct": 100.0 * (median(ratios) - 1.0),
        "verdict": verdict([100.0 * (r - 1.0) for r in ratios], TARGET_PCT),
        "target_pct": TARGET_PCT,
        # rank 0's own step time (batch .. optimizer step): the reduction's wait is inside it
        "allreduce_in_step_s": median(in_step["allreduce"]),
        "fixed_in_step_s": median(in_step["fixed"]),
        "in_step_overhead_pct": 100.0 * (median(f / a for a, f in zip(in_step["allreduce"], in_step["fixed"])) - 1.0),
        # the 4 ranks' CPU seconds per step (None: a run too short to sample)
        "cpu_s_per_step": {red: _num(median(v for v in cpu[red] if v is not None)) for red in cpu},
        "cpu_overhead_pct": 100.0 * (median(cpu_ratios) - 1.0) if cpu_ratios else None,
        "run_dirs": {red: [str(r.run_dir) for r in rs] for red, rs in runs.items()},
    }
    return out


# ---------------------------------------------------------------- 2 and 3: the shrink
def _check_shrunk(run: Any) -> Dict[str, Any]:
    shrunk = run.of("shrunk")
    recs = run.summary.get("recoveries", [])
    if len(shrunk) != 1 or len(recs) != 1 or run.of("spare_promoted"):
        raise BenchError(f"B9: {run.run_dir} should shrink once and promote nobody: {len(shrunk)} shrunk event(s), {len(recs)} recoveries, "
                         f"{len(run.of('spare_promoted'))} promotion(s); see its events.jsonl")
    return shrunk[0]


def _check_promoted(run: Any) -> None:
    recs = run.summary.get("recoveries", [])
    if len(run.of("spare_promoted")) != 1 or len(recs) != 1 or run.of("shrunk"):
        raise BenchError(f"B9: {run.run_dir} should promote its spare once and not shrink: {len(run.of('spare_promoted'))} promotion(s), "
                         f"{len(recs)} recoveries, {len(run.of('shrunk'))} shrunk event(s); see its events.jsonl")


def degraded(run: Any, skip: int, post_skip: int) -> Dict[str, Any]:
    """Step intervals (and the workers' CPU per step) of one shrinking run before and after its shrink."""
    ev = _check_shrunk(run)
    gen = ev["gen"]
    before = [e for e in run.of("step") if e.get("gen") == 0 and e.get("step") is not None]
    after = _steps(run, gen)
    iv_b, iv_a = _intervals(before, skip), _intervals(after, post_skip)
    if len(iv_b) < 2 or len(iv_a) < 2:
        raise BenchError(f"B9: {run.run_dir}: too few steps to time ({len(iv_b)} intervals before the shrink, {len(iv_a)} after): raise b9_shrink_steps")
    cpu_b, cpu_a = _cpu(run, before, skip), _cpu(run, after, post_skip)
    return {
        "step_s_before": median(iv_b), "step_s_after": median(iv_a), "intervals": [len(iv_b), len(iv_a)],
        "cpu_s_per_step_before": cpu_b, "cpu_s_per_step_after": cpu_a,
        "processes_after": ev["processes"], "shrunk_gen": gen, "shrunk_step": ev["step"],
    }


def shrink_point(bench: Any, nodes: int, min_nodes: int, promote: bool, reps: int) -> Dict[str, Any]:
    p = bench.plan
    base = [*task_overrides(p.b9_size), *NO_REFILL, f"train.steps={p.b9_shrink_steps}", f"cluster.nodes={nodes}", f"cluster.min_nodes={min_nodes}", "train.reduction=fixed"]
    fault = ["fault=kill_node", f"fault.node={nodes - 1}", f"fault.step={p.b9_fault_step}"]
    shrinks: List[Any] = []
    promos: List[Any] = []
    for rep in range(reps):  # interleaved: shrink, promotion, shrink, promotion
        shrinks = bench.job(f"b9-shrink-n{nodes}", base + ["cluster.spare_nodes=0"] + fault, rep + 1, sample_cpu=True)
        if promote:
            promos = bench.job(f"b9-promote-n{nodes}", base + ["cluster.spare_nodes=1"] + fault, rep + 1)
    for r in promos:
        _check_promoted(r)
    clean = bench.job(f"b9-fault-free-n{nodes}", base + ["cluster.spare_nodes=1"])[0]  # the oracle (a spare that is never used changes no bits)
    if clean.summary.get("recoveries") or clean.of("shrunk"):
        raise BenchError(f"B9: the fault-free run {clean.run_dir} recovered or shrank: no oracle")
    sha = clean.summary["final_state_sha256"]
    deg = [degraded(r, p.b9_skip, p.b9_post_skip) for r in shrinks]
    live = deg[0]["processes_after"]
    ratios = [d["step_s_after"] / d["step_s_before"] for d in deg]
    cpu_ratios = [d["cpu_s_per_step_after"] / d["cpu_s_per_step_before"] for d in deg if d["cpu_s_per_step_after"] and d["cpu_s_per_step_before"]]
    ideal, bound = nodes / live, math.ceil(nodes / live)
    slowdown = median(ratios)

    def phases(runs: List[Any]) -> Dict[str, float]:
        return _phases([r.summary["recoveries"][0] for r in runs])

    out: Dict[str, Any] = {
        "nodes": nodes, "min_nodes": min_nodes, "lost_node": nodes - 1, "virtual_ranks": nodes, "live_after": live,
        "size": p.b9_size, "params": lm_params(p.b9_size), "steps": p.b9_shrink_steps, "fault_step": p.b9_fault_step, "reps": reps,
        "step_s_before": median(d["step_s_before"] for d in deg), "step_s_after": median(d["step_s_after"] for d in deg),
        "slowdown": slowdown, "per_run_slowdown": ratios,
        "ideal_slowdown": ideal, "vs_ideal_pct": 100.0 * (slowdown / ideal - 1.0),
        "bound_slowdown": bound, "vs_bound_pct": 100.0 * (slowdown / bound - 1.0),
        "cpu_ratio": median(cpu_ratios) if cpu_ratios else None,  # workers' CPU per step after / before: ideally 1.0
        "degraded": deg,
        "shrink": dict(phases(shrinks), oracle=all(r.summary["final_state_sha256"] == sha for r in shrinks), run_dirs=[str(r.run_dir) for r in shrinks]),
        "fault_free_final_sha": sha,
        "fault_free_run_dir": str(clean.run_dir),
    }
    out["cpu_extra_pct"] = None if out["cpu_ratio"] is None else 100.0 * (out["cpu_ratio"] - 1.0)
    out["oracle"] = out["shrink"]["oracle"]
    if promote:
        out["promotion"] = dict(phases(promos), oracle=all(r.summary["final_state_sha256"] == sha for r in promos), run_dirs=[str(r.run_dir) for r in promos])
        out["shrink_over_promotion"] = out["shrink"]["downtime_s"] / out["promotion"]["downtime_s"]
        out["oracle"] = out["oracle"] and out["promotion"]["oracle"]
    return out


def _phases(recs: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {k: median(rec[k] for rec in recs) for k in PHASES}
    out["recovery_s"] = median(rec["detect_s"] + rec["reconfigure_s"] + rec["transfer_s"] for rec in recs)  # net of the first step
    out["spread"] = spread(rec["downtime_s"] for rec in recs)
    return out


def grow_point(bench: Any, nodes: int, min_nodes: int, mode: str, reps: int) -> Dict[str, Any]:
    """A shrink, then the grow-back onto the refill once it is built: both recoveries' downtime
    (``recoveries[0]``, ``moves[0]``: the grow-back is a planned move, timed from its boundary), for
    ``parallel=mode`` (zero: the survivor takes the lost shard over, the refill fetches it back)."""
    p = bench.plan
    base = [*task_overrides(p.b9_size), f"train.steps={p.b9_shrink_steps}", f"cluster.nodes={nodes}", f"cluster.min_nodes={min_nodes}", "train.reduction=fixed"]
    base += [f"parallel={mode}", "cluster.spare_nodes=0"] + (["replication.factor=1"] if mode == "zero" else [])
    fault = ["fault=kill_node", f"fault.node={nodes - 1}", f"fault.step={p.b9_fault_step}"]
    if p.b9_grow_slow_steps:  # no plan sets it: the grow-backs of the full plan run with no straggler
        fault.append(f"fault.schedule=[{{kind:slow,rank:0,step:{p.b9_fault_step + 1},duration:{p.b9_grow_slow_steps},factor:3}}]")
    runs = bench.job(f"b9-grow-{mode}-n{nodes}", base + ["cluster.refill_spares=true", "cluster.max_refills=1"] + fault, reps)
    for r in runs:
        if len(r.of("shrunk")) != 1 or len(r.of("grown")) != 1 or len(r.summary.get("recoveries", [])) != 1 or len(r.summary.get("moves", [])) != 1:
            raise BenchError(f"B9: {r.run_dir} should shrink once, then grow back once: {len(r.of('shrunk'))} shrunk, {len(r.of('grown'))} grown event(s); "
                             "the refill may not have been built before the end (raise b9_shrink_steps or b9_grow_slow_steps)")
    clean = bench.job(f"b9-fault-free-{mode}-n{nodes}", base + NO_REFILL)[0]
    sha = clean.summary["final_state_sha256"]
    return {
        "mode": mode, "nodes": nodes, "min_nodes": min_nodes, "size": p.b9_size, "params": lm_params(p.b9_size), "reps": reps,
        "shrink": _phases([r.summary["recoveries"][0] for r in runs]),
        "grow": _phases([r.summary["moves"][0] for r in runs]),  # a planned move at a step boundary since issue 33
        # each run's grow-back apart (a median of 2 hides one that stalled): its phases, its first step's time, its run dir
        "grow_runs": [dict({k: r.summary["moves"][0][k] for k in PHASES}, run_dir=str(r.run_dir)) for r in runs],
        "degraded_s": median(r.summary["degraded"]["seconds"] for r in runs),
        "oracle": all(r.summary["final_state_sha256"] == sha for r in runs),
        "run_dirs": [str(r.run_dir) for r in runs], "fault_free_run_dir": str(clean.run_dir),
    }


def run(bench: Any) -> Dict[str, Any]:
    p = bench.plan
    res: Dict[str, Any] = {"overhead": overhead(bench), "shrink": [], "grow": []}
    for i, (nodes, min_nodes) in enumerate(p.b9_shrinks):
        res["shrink"].append(shrink_point(bench, nodes, min_nodes, promote=i == 0, reps=p.b9_shrink_reps if i == 0 else 1))
    if p.b9_grow_reps:
        nodes, min_nodes = p.b9_shrinks[0]
        res["grow"] = [grow_point(bench, nodes, min_nodes, mode, p.b9_grow_reps) for mode in p.b9_grow_modes]
    res["oracle"] = all(pt["oracle"] for pt in res["shrink"] + res["grow"])
    return res


def grow_only(bench: Any) -> Dict[str, Any]:
    """``python -m bench --only b9_grow``: B9's grow-backs (each of ``b9_grow_modes``) beside a
    spare's promotion and a shrink of the same node loss (B9's first shrink point), without B9's
    reduction pairs and further shrink points: 11 jobs of the full plan instead of about 30."""
    p = bench.plan
    nodes, min_nodes = p.b9_shrinks[0]
    pt = shrink_point(bench, nodes, min_nodes, promote=True, reps=p.b9_shrink_reps)
    grow = [grow_point(bench, nodes, min_nodes, mode, max(1, p.b9_grow_reps)) for mode in p.b9_grow_modes]
    return {"shrink": [pt], "grow": grow, "oracle": pt["oracle"] and all(g["oracle"] for g in grow)}


def grow_headline(res: Dict[str, Any]) -> Dict[str, Any]:
    """``b9_grow``'s keys in latest.json: the grow-backs' (the full run's B9 writes the same keys);
    its promotion stays in its section, beside them (``b9_promotion_downtime_s`` is B9's)."""
    return {f"b9_grow_downtime_s_{g['mode']}": g["grow"]["downtime_s"] for g in res["grow"]}


# ---------------------------------------------------------------- output
def table(res: Dict[str, Any]) -> str:
    lines = ["B9 elastic"]
    o = res.get("overhead")  # b9_grow has none
    if o:
        lines.append(
            f"fixed vs allreduce, {o['params'] / 1e6:.1f} M, {o['ranks']} ranks: {1e3 * o['allreduce_step_s']:.1f} -> {1e3 * o['fixed_step_s']:.1f} ms/step, "
            f"{o['overhead_pct']:+.1f}% (pairs {[round(x, 3) for x in o['pair_ratios']]}; target <= +{o['target_pct']:.0f}%: {o['verdict']}); "
            f"CPU/step {_pp(o['cpu_overhead_pct'])}"
        )
    lines.append("nodes -> live  step before  step after  slowdown  ideal  vs ideal  bound  vs bound  CPU after/before  oracle")
    for pt in res["shrink"]:
        cpu = pt["cpu_ratio"]
        lines.append(
            f"{pt['nodes']:5d} -> {pt['live_after']:<4d} {pt['step_s_before']:10.3f}s {pt['step_s_after']:10.3f}s {pt['slowdown']:8.2f}x {pt['ideal_slowdown']:5.2f}x "
            f"{pt['vs_ideal_pct']:+8.1f}% {pt['bound_slowdown']:5d}x {pt['vs_bound_pct']:+8.1f}%  {'n/a' if cpu is None else f'{cpu:.2f}':>16}  {pt['oracle']}"
        )
    for pt in res["shrink"]:
        if "promotion" in pt:
            s, q = pt["shrink"], pt["promotion"]
            lines.append(
                f"downtime, {pt['nodes']} nodes: shrink {s['downtime_s']:.3f}s (detect {s['detect_s']:.3f} + reconf {s['reconfigure_s']:.3f} + transfer {s['transfer_s']:.3f} "
                f"+ first step {s['resume_s']:.3f}) vs spare promotion {q['downtime_s']:.3f}s (detect {q['detect_s']:.3f} + reconf {q['reconfigure_s']:.3f} + transfer "
                f"{q['transfer_s']:.3f} + first step {q['resume_s']:.3f}): x{pt['shrink_over_promotion']:.2f}; oracle {s['oracle']} / {q['oracle']}"
            )
    for g in res.get("grow", []):
        s, q = g["shrink"], g["grow"]
        lines.append(
            f"shrink then grow back, {g['mode']}, {g['nodes']} nodes: shrink {s['downtime_s']:.3f}s (net of the first step {s['recovery_s']:.3f}s, {s['bytes_transferred'] / 1e6:.1f} MB), "
            f"grow back {q['downtime_s']:.3f}s (net {q['recovery_s']:.3f}s, {q['bytes_transferred'] / 1e6:.1f} MB to the refill), degraded {g['degraded_s']:.1f}s; oracle {g['oracle']}"
        )
    return "\n".join(lines)


def _pp(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:+.1f}%"


def headline(res: Any) -> Dict[str, Any]:
    ok = bool(res) and "overhead" in res and res.get("shrink")
    pt = res["shrink"][0] if ok else {}
    grown = {g["mode"]: g["grow"]["downtime_s"] for g in res.get("grow", [])} if ok else {}  # the full plan only
    return {
        "b9_fixed_overhead_pct_4ranks": res["overhead"]["overhead_pct"] if ok else None,
        "b9_degraded_vs_ideal_pct": pt.get("vs_ideal_pct"),
        "b9_shrink_downtime_s": pt["shrink"]["downtime_s"] if pt else None,
        "b9_promotion_downtime_s": pt["promotion"]["downtime_s"] if pt and "promotion" in pt else None,
        **{f"b9_grow_downtime_s_{mode}": grown.get(mode) for mode in ("ddp", "zero")},
    }
