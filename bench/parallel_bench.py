"""``python -m bench.parallel_bench [--quick]``: tensor and pipeline parallel (issue 31, "Measured"), side by side in one run.

1. The step of TP=2 x 2 replicas and of PP=2 x 2 replicas (gpipe over ``train.grad_accum``
   micro-batches) under ckptless_hpc against the same layout in plain torch, no fault tolerance
   (bench/plain_parallel_worker.py: a device mesh, ``parallelize_module`` or ``PipelineStage`` +
   ``ScheduleGPipe``, the gradients all-reduced over the data-parallel group). Back-to-back pairs
   (a ckptless run, then the plain run of the same layout; TP's pair, then PP's, alternating):
   per pair the ratio of the median step intervals (rank 0's step events, warm-up skipped), the
   overhead the median of the ratios, and the verdict on the 2 % target from every pair
   (bench/common.py ``verdict``). Each run's CPU seconds per step (its ranks only) are sampled too:
   they drift less than wall time on a shared machine.
2. The downtime of a killed TP rank and of a killed PP rank (``fault=kill_worker fault.rank=3``:
   a rank of replica 1) against a ddp promotion of the same model on the same 4 ranks, with each
   recovery's phases and the bytes it moved (summary.json ``recoveries[0]``): a TP or PP rank's
   state is its coordinate's shard (about half the model at tp=2 or pp=2), a ddp rank's the whole
   state. Each faulted run's ``final_state_sha256`` is checked against its fault-free run's (the
   oracle: for TP and PP the first pair's ckptless run, whose config differs only by the fault);
   a fault that never fired is an error, not a result.
3. ``--interleave TURNS`` (the step comparison alone): the ckptless_hpc job and the plain run
   alive at once, taking turns of ``--block`` steps (bench/gate.py), so that each turn's two
   figures are seconds apart instead of a run apart; the overhead is the median of the turns'
   ratios, with its interval.

Every run is a real job (``python -m ckptless_hpc``) or 4 real plain processes; nothing is
simulated. Writes ``bench/results/only-parallel.json`` (``--quick``: ``quick-parallel.json``),
the name ``python -m bench --only parallel`` gives it. Run directories go to ``bench/results/tmp``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # python bench/parallel_bench.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

from .common import REPO, BenchError, CpuSampler, JobRun, cpu_per_step, cpu_within, finite, free_port_store, kill_all, machine_info, median, median_interval, median_verdict, read_jsonl, run_ckptless, spread, verdict  # noqa: E402

TARGET_PCT = 2.0  # issue 31: the step's overhead over plain torch
TASK = "examples.llama.LlamaParallelTask"
RESULTS = REPO / "bench" / "results"


@dataclass(frozen=True)
class Plan:
    """One variant of the section: the model (LlamaParallelTask's arguments), the run lengths, the fault."""

    name: str
    task: Dict[str, int]
    steps: int  # per run: the step runs and every fault run (the fault-free run is the oracle)
    skip_steps: int  # warm-up steps left out of the step intervals and CPU samples
    pairs: int  # back-to-back (ckptless, plain) pairs per layout
    fault_step: int  # kill_worker of rank 3 at this step
    micro_batches: int = 4  # PP: train.grad_accum, gpipe's micro-batches
    job_timeout_s: float = 300.0


PLANS = {
    # the smoke test: the task's own sizes, one pair, a few steps
    "quick": Plan("quick", dict(dim=32, n_layers=2, hidden=48, seq_len=12, batch_size=4), steps=8, skip_steps=2, pairs=1, fault_step=4),
    # 0.74 M parameters (8.9 MB of state with AdamW): a step of 0.1-0.4 s on the 2-core dev box, with 4 ranks and a spare node on it
    "full": Plan("full", dict(dim=128, n_layers=4, hidden=344, seq_len=32, batch_size=8), steps=60, skip_steps=10, pairs=3, fault_step=30),
    # the same model with 8x the tokens per step (2,048 per replica): the per-step costs of both sides (the
    # collectives, the snapshot, the norm) against more compute, nearer a real LLM step's share (--plan tokens; ~8 min)
    "tokens": Plan("tokens", dict(dim=128, n_layers=4, hidden=344, seq_len=64, batch_size=32), steps=30, skip_steps=5, pairs=3, fault_step=15, job_timeout_s=600),
}

# recoveries without the spare pool's background refill (as B1: on one 2-core machine the refill's
# process start competes with the first step after the recovery, which a cluster runs elsewhere);
# given to every ckptless run, so that a faulted run and its fault-free run differ by the fault alone
NO_REFILL = ["cluster.refill_spares=false"]
# both sides clip the gradients to a global norm of 1.0, torchtitan's default (and Megatron's): what
# a user of these layouts trains with; the plain worker computes the norm as torchtitan does
CLIP = 1.0
LAYOUT = ["cluster.nodes=2", "cluster.workers_per_node=2"]
RECOVERY_MODES = ("tp", "pp", "ddp", "ddp_whole")


def log(msg: str) -> None:
    print(f"[parallel {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


_f = finite


def _env() -> Dict[str, str]:
    """The jobs' workers import ``examples.*``: the repository root on their path, whatever the caller's."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join([str(REPO)] + ([path] if path else []))}


def overrides(plan: Plan, mode: str, fault: bool = False, gate: Optional[Path] = None) -> List[str]:
    """The ckptless_hpc command line of one run: ``mode`` is tp, pp, ddp or ddp_whole; ``fault``: rank 3 killed at ``plan.fault_step``;
    ``gate``: the same task behind bench/gate.py's gate at that path (--interleave)."""
    target = [f"+task._target_={TASK}"] if gate is None else ["+task._target_=bench.gate.GatedLlamaParallelTask", f"+task.gate={gate}"]
    task = ["~task", *target] + [f"+task.{k}={v}" for k, v in plan.task.items()]
    par = {
        "tp": ["parallel=tp", "parallel.tp=2"],
        "pp": ["parallel=pp", "parallel.pp=2", "parallel.pp_schedule=gpipe", f"train.grad_accum={plan.micro_batches}"],
        "ddp": ["parallel=ddp"],
        # ddp with its whole state before the first step: what a ddp promotion moves in all (the default moves the parameters first, the rest behind the step)
        "ddp_whole": ["parallel=ddp", "cluster.params_first=false"],
    }[mode]
    kill = ["fault=kill_worker", "fault.rank=3", f"fault.step={plan.fault_step}"] if fault else []
    return task + par + LAYOUT + NO_REFILL + [f"train.steps={plan.steps}", f"train.clip_grad_norm={CLIP}"] + kill


# ------------------------------------------------------------------------------ plain torch
@dataclass
class PlainRun:
    """A finished plain run: rank 0's events and the CPU samples of its processes."""

    run_dir: Path
    events: List[Dict[str, Any]]
    cpu_samples: List[tuple]

    def steps(self) -> List[Dict[str, Any]]:
        return [e for e in self.events if e["ev"] == "step"]

    def step_intervals(self, skip: int) -> List[float]:
        s = self.steps()
        return [b["t"] - a["t"] for a, b in zip(s, s[1:]) if b["step"] == a["step"] + 1 and a["step"] > skip]

    def step_times(self, skip: int) -> List[float]:
        return [e["step_s"] for e in self.steps() if e["step"] > skip]

    def final_loss(self) -> Optional[float]:
        return next((e["loss"] for e in self.events if e["ev"] == "final_loss"), None)


def run_plain(run_dir: Path, plan: Plan, mode: str, world: int = 4, seed: int = 0, gate: Optional[Path] = None) -> PlainRun:
    """``world`` plain processes (bench/plain_parallel_worker.py) of ``mode`` (tp or pp), to the end; their CPU sampled
    (``gate``: each rank stops at bench/gate.py's gate at that path after each step)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    store = free_port_store()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **_env())
    sampler = CpuSampler(os.getpid()).start()
    procs: List[subprocess.Popen] = []
    try:
        for r in range(world):
            argv = [
                sys.executable, "-m", "bench.plain_parallel_worker", "--mode", mode, "--rank", str(r), "--world", str(world),
                "--store", f"127.0.0.1:{store.port}", "--prefix", "plain", "--task", json.dumps(plan.task), "--steps", str(plan.steps),
                "--micro", str(plan.micro_batches), "--seed", str(seed), "--clip", str(CLIP), "--events", str(run_dir / f"r{r}.jsonl"),
            ] + (["--gate", str(gate)] if gate is not None else [])  # fmt: skip
            with open(run_dir / f"r{r}.log", "wb") as out:
                procs.append(subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + plan.job_timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        samples = sampler.stop()
        bad = [(r, p.poll()) for r, p in enumerate(procs) if p.poll() != 0]
        kill_all(procs)
    if bad:
        r = bad[0][0]
        tail = (run_dir / f"r{r}.log").read_text(errors="replace")[-2000:]
        raise BenchError(f"plain {mode} run in {run_dir}: ranks (rank, rc) {bad} did not finish (rc None: past {plan.job_timeout_s:.0f}s). HINT: see {run_dir}/r{r}.log:\n{tail}")
    return PlainRun(run_dir, read_jsonl(run_dir / "r0.jsonl"), samples)


# ------------------------------------------------------------------------------ the measurements
def _is_active_rank(cmd: str) -> bool:
    """A worker process of the two active nodes (local0, local1), not a spare's."""
    return "ckptless_hpc.worker" in cmd and ("--node local0 " in cmd or "--node local1 " in cmd)


def _is_plain_rank(cmd: str) -> bool:
    return "bench.plain_parallel_worker" in cmd


class _Runs:
    """Numbered run directories under ``tmp``; each run logged with its wall time."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.n = tmp, 0

    def dir(self, label: str) -> Path:
        self.n += 1
        d = self.tmp / f"{self.n:02d}-{label}"
        shutil.rmtree(d, ignore_errors=True)
        return d

    def job(self, label: str, plan: Plan, ovr: Sequence[str], sample_cpu: bool = False) -> JobRun:
        t0 = time.monotonic()
        j = run_ckptless(self.dir(label), list(ovr), timeout_s=plan.job_timeout_s, sample_cpu=sample_cpu, env=_env())
        log(f"  {label}: {time.monotonic() - t0:.0f}s ({j.run_dir.name})")
        return j

    def plain(self, label: str, plan: Plan, mode: str) -> PlainRun:
        t0 = time.monotonic()
        r = run_plain(self.dir(label), plan, mode)
        log(f"  {label}: {time.monotonic() - t0:.0f}s ({r.run_dir.name})")
        return r


def _pair(plan: Plan, j: JobRun, b: PlainRun) -> Dict[str, Any]:
    """One back-to-back pair's figures: each side's median step interval, in-step time and CPU per step, and their ratios."""
    ck_iv, pl_iv = j.step_intervals(skip=plan.skip_steps), b.step_intervals(plan.skip_steps)
    if not ck_iv or not pl_iv:
        raise BenchError(f"a pair has no step intervals past step {plan.skip_steps} (ckptless {len(ck_iv)}, plain {len(pl_iv)}). HINT: steps > skip_steps + 1 ({j.run_dir})")
    ck_times = [e["time"] for e in j.of("step")]
    ck_cpu = cpu_per_step(j.cpu_samples or [], ck_times, _is_active_rank, plan.skip_steps)
    pl_cpu = cpu_per_step(b.cpu_samples, [e["t"] for e in b.steps()], _is_plain_rank, plan.skip_steps)
    out = {
        "ckptless_step_s": median(ck_iv),
        "plain_step_s": median(pl_iv),
        "ckptless_in_step_s": median(j.step_times(skip=plan.skip_steps)),
        "plain_in_step_s": median(b.step_times(plan.skip_steps)),
        "ckptless_cpu_s_per_step": ck_cpu,
        "plain_cpu_s_per_step": pl_cpu,
        # the whole job's: the 4 ranks, the coordinator and the spare node's 2 waiting workers
        "ckptless_all_cpu_s_per_step": cpu_per_step(j.cpu_samples or [], ck_times, lambda cmd: True, plan.skip_steps),
        "ckptless_final_loss": j.summary.get("final_loss"),
        "plain_final_loss": b.final_loss(),
        "ckptless_run": j.run_dir.name,
        "plain_run": b.run_dir.name,
    }
    out["ratio"] = out["ckptless_step_s"] / out["plain_step_s"]
    out["cpu_ratio"] = ck_cpu / pl_cpu if pl_cpu and pl_cpu == pl_cpu else float("nan")
    return out


def _layout_summary(pairs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A layout's figures over its pairs: the overhead is the median of the pairs' ratios (robust to load drifting between pairs)."""
    overheads = [100.0 * (p["ratio"] - 1.0) for p in pairs]
    cpu = [100.0 * (p["cpu_ratio"] - 1.0) for p in pairs if p["cpu_ratio"] == p["cpu_ratio"]]
    losses = [abs(p["ckptless_final_loss"] - p["plain_final_loss"]) for p in pairs if p["ckptless_final_loss"] is not None and p["plain_final_loss"] is not None]
    return {
        "ckptless_step_s": median(p["ckptless_step_s"] for p in pairs),
        "plain_step_s": median(p["plain_step_s"] for p in pairs),
        "overhead_pct": 100.0 * (median(p["ratio"] for p in pairs) - 1.0),
        "pair_overheads_pct": overheads,
        # <= 2 % only when every pair says so ("unresolved at this load" when they disagree)
        "verdict": verdict(overheads, TARGET_PCT),
        # the median's own verdict: a distribution-free 90 % interval of the pairs' median (5 pairs or more, --pairs)
        "median_interval_pct": median_interval(overheads),
        "median_verdict": median_verdict(overheads, TARGET_PCT),
        "ckptless_in_step_s": median(p["ckptless_in_step_s"] for p in pairs),
        "plain_in_step_s": median(p["plain_in_step_s"] for p in pairs),
        "cpu_overhead_pct": median(cpu) if cpu else None,
        "pair_cpu_overheads_pct": cpu,
        "cpu_overhead_all_pct": median(100.0 * (p["ckptless_all_cpu_s_per_step"] / p["plain_cpu_s_per_step"] - 1.0) for p in pairs if p["plain_cpu_s_per_step"]),
        # the same training: the last step's loss over the global batch, ckptless_hpc's summary against the plain run's
        "final_loss_abs_diff_max": max(losses) if losses else None,
        "pairs": pairs,
    }


def _ratio(a: Optional[float], b: Optional[float]) -> float:
    return float(a) / float(b) if a is not None and b else float("nan")


def _recovery(j: JobRun, oracle_sha: str, what: str) -> Dict[str, Any]:
    """A faulted run's first recovery (its phases and the bytes it moved) and its oracle; an unfired fault is an error."""
    s = j.summary
    if not s.get("faults_fired"):
        raise BenchError(f"{what}: the fault never fired (summary.json faults_fired={s.get('faults_fired')}) in {j.run_dir}. HINT: fault.step must be below train.steps")
    recs = s.get("recoveries") or []
    if not recs:
        raise BenchError(f"{what}: the fault fired but summary.json has no recovery in {j.run_dir}. HINT: see {j.run_dir}/coordinator.log")
    rec = recs[0]
    keys = ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s", "bytes_transferred")
    out: Dict[str, Any] = {k: rec.get(k) for k in keys}
    out.update(
        failed_ranks=rec.get("failed_ranks"),
        replacements=rec.get("replacements"),
        recoveries=len(recs),
        final_state_sha256=s.get("final_state_sha256"),
        fault_free_sha256=oracle_sha,
        oracle=s.get("final_state_sha256") == oracle_sha,  # bitwise equal to the fault-free run of the same config
        step_s=median(j.step_intervals(skip=1)),
        run=j.run_dir.name,
    )
    return out


def model_figures(task: Dict[str, int]) -> Dict[str, int]:
    """The model's parameter count and its whole training state (fp32 parameters + AdamW's two moments), without running anything."""
    from examples.llama import LlamaParallelTask

    params = sum(p.numel() for p in LlamaParallelTask(**task).build_model().parameters())
    return {"params": params, "state_bytes": 3 * 4 * params}


def measure(quick: bool, tmp: Optional[Path] = None, plan_name: Optional[str] = None, pairs_n: Optional[int] = None) -> Dict[str, Any]:
    """The section (JSON-able): the TP and PP step pairs, then the three recoveries. ``tmp``: where the run directories go;
    ``pairs_n``: pairs per layout in place of the plan's."""
    plan = PLANS[plan_name or ("quick" if quick else "full")]
    if pairs_n is not None:
        plan = dataclasses.replace(plan, pairs=pairs_n)
    runs = _Runs(tmp or RESULTS / "tmp" / "parallel")
    runs.tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    log(f"{plan.name}: LlamaParallelTask {plan.task}, 2 replicas x 2 ranks, {plan.steps} steps (first {plan.skip_steps} skipped), {plan.pairs} back-to-back pair(s) per layout")
    pairs: Dict[str, List[Dict[str, Any]]] = {"tp": [], "pp": []}
    fault_free: Dict[str, JobRun] = {}
    for rep in range(plan.pairs):
        for mode in ("tp", "pp"):  # ckptless then plain, TP's pair then PP's: load drifting over the run touches both sides of a pair alike
            j = runs.job(f"{mode}-ckptless", plan, overrides(plan, mode), sample_cpu=True)
            b = runs.plain(f"{mode}-plain", plan, mode)
            fault_free.setdefault(mode, j)
            pairs[mode].append(_pair(plan, j, b))
            p = pairs[mode][-1]
            log(f"  {mode} pair {rep + 1}: ckptless {1e3 * p['ckptless_step_s']:.1f} ms, plain {1e3 * p['plain_step_s']:.1f} ms: {100 * (p['ratio'] - 1):+.1f}%")
    log(f"recoveries: rank 3 killed at step {plan.fault_step} under tp, pp, ddp (parameters first, the default) and ddp with its whole state first")
    # params_first acts only in a recovery: one fault-free ddp run is the oracle of both ddp runs
    fault_free["ddp"] = fault_free["ddp_whole"] = runs.job("ddp-fault-free", plan, overrides(plan, "ddp"))
    rec = {}
    for mode in RECOVERY_MODES:
        j = runs.job(f"{mode}-kill", plan, overrides(plan, mode, fault=True))
        rec[mode] = _recovery(j, fault_free[mode].summary["final_state_sha256"], f"{mode} kill_worker rank 3")
        log(f"  {mode}: downtime {rec[mode]['downtime_s']:.2f}s, {rec[mode]['bytes_transferred'] / 1e6:.2f} MB moved before the first step, bitwise: {rec[mode]['oracle']}")
    for mode in ("tp", "pp"):
        r = rec[mode]
        # against ddp's whole state (what the issue compares: the lost coordinate's shard vs everything), and against what
        # the default ddp promotion puts before its first step (the parameters alone)
        r["bytes_ratio_vs_ddp"] = _ratio(r["bytes_transferred"], rec["ddp_whole"]["bytes_transferred"])
        r["bytes_ratio_vs_ddp_params_first"] = _ratio(r["bytes_transferred"], rec["ddp"]["bytes_transferred"])
        r["downtime_ratio_vs_ddp"] = _ratio(r["downtime_s"], rec["ddp"]["downtime_s"])
    out: Dict[str, Any] = {
        "plan": plan.name,
        "task": TASK,
        "sizes": dict(plan.task),
        **model_figures(plan.task),
        "replicas": 2,
        "world": 4,
        "spare_nodes": 1,
        "steps": plan.steps,
        "skip_steps": plan.skip_steps,
        "pairs": plan.pairs,
        "pp_schedule": "gpipe",
        "pp_micro_batches": plan.micro_batches,
        "target_pct": TARGET_PCT,
        "tp": _layout_summary(pairs["tp"]),
        "pp": _layout_summary(pairs["pp"]),
        "fault": {"kind": "kill_worker", "rank": 3, "step": plan.fault_step},
        "recovery": rec,
        "oracle": all(r["oracle"] for r in rec.values()),
        "step_spread": {m: spread(p["ckptless_step_s"] for p in pairs[m]) for m in pairs},
        "elapsed_s": time.monotonic() - t0,
    }
    return out


# ------------------------------------------------------------------------------ interleaved
def _in_thread(fn: Callable[[], Any]) -> Tuple[threading.Thread, Dict[str, Any]]:
    """``fn()`` in a thread; its result or its exception lands in the dict."""
    out: Dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised by the harness)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _cores_within(samples: List[tuple], windows: List[Tuple[float, float]], match: Callable[[str], bool]) -> float:
    """CPU seconds per second of the sampled processes whose command line satisfies ``match``, within ``windows``
    (each from its first sample to its last; windows with fewer than 2 samples are left out)."""
    cpu = span = 0.0
    for got in (cpu_within(samples, lo, hi, match) for lo, hi in windows):
        if got is not None:
            cpu, span = cpu + got[0], span + got[2] - got[1]
    return cpu / span if span > 0 else float("nan")


def interleaved(runs: "_Runs", plan: Plan, mode: str, blocks: int, block: int, extra: Sequence[str] = ()) -> Dict[str, Any]:
    """One ckptless_hpc job and one plain run of ``mode`` alive at once, taking turns by ``block`` steps
    (bench/gate.py): per block the ratio of the two medians of clean step intervals, every rank's; the
    turns alternate which side goes first (ABBA), so a drift within a block touches both alike.
    ``extra``: overrides of the ckptless_hpc side only (a diagnosis: which of its costs is it)."""
    from . import gate as G

    steps = plan.skip_steps + blocks * block
    p = dataclasses.replace(plan, steps=steps)
    d = runs.dir(f"{mode}-interleaved")
    gates = d / "gate"
    gates.mkdir(parents=True)
    ck_gate, pl_gate = gates / "ckptless", gates / "plain"
    for g in (ck_gate, pl_gate):
        G.allow(g, plan.skip_steps)
    t0 = time.monotonic()
    ck_t, ck = _in_thread(lambda: run_ckptless(d / "ckptless", [*overrides(p, mode, gate=ck_gate), *extra], timeout_s=plan.job_timeout_s + 30 * blocks, sample_cpu=True, env=_env()))
    pl_t, pl = _in_thread(lambda: run_plain(d / "plain", dataclasses.replace(p, job_timeout_s=plan.job_timeout_s + 30 * blocks), mode, gate=pl_gate))

    def alive() -> bool:
        return ck_t.is_alive() and pl_t.is_alive()

    per_block: List[Tuple[List[float], List[float]]] = []
    turns: Dict[Path, List[Tuple[float, float]]] = {ck_gate: [], pl_gate: []}  # each side's turns (time.time())
    try:
        for g in (ck_gate, pl_gate):
            G.wait_parked(g, 4, plan.skip_steps, plan.job_timeout_s, alive)
        done = plan.skip_steps
        for k in range(blocks):
            for g in (ck_gate, pl_gate) if k % 2 == 0 else (pl_gate, ck_gate):
                t_turn = time.time()
                G.allow(g, done + block)
                G.wait_parked(g, 4, done + block, plan.job_timeout_s, alive)
                turns[g].append((t_turn, time.time()))
            per_block.append((G.block_intervals(ck_gate, done, done + block), G.block_intervals(pl_gate, done, done + block)))
            done += block
    except TimeoutError as e:
        if alive():
            raise BenchError(f"{mode} interleaved: {e} (see {d})") from None
    finally:
        for g in (ck_gate, pl_gate):
            G.allow(g, 1 << 30)
        ck_t.join()
        pl_t.join()
    for side, out in (("ckptless", ck), ("plain", pl)):
        if "error" in out:
            raise BenchError(f"{mode} interleaved, the {side} side: {out['error']}") from out["error"]
    if len(per_block) != blocks:  # a side ended before its turns did, without an error: no figure from part of the run
        raise BenchError(f"{mode} interleaved: {len(per_block)} of {blocks} turns ran (see {d})")
    j, b = ck["result"], pl["result"]
    ratios = G.block_pairs(per_block)
    overheads = [100.0 * (r - 1.0) for r in ratios]
    ck_all, pl_all = [x for a, _ in per_block for x in a], [x for _, b_ in per_block for x in b_]
    log(f"  {mode} interleaved: {blocks} blocks of {block} steps in {time.monotonic() - t0:.0f}s: median {100 * (median(ratios) - 1):+.2f}% ({_pct(median_interval(overheads).get('low'))} .. {_pct(median_interval(overheads).get('high'))})")
    return {
        "blocks": blocks,
        "block_steps": block,
        "ckptless_step_s": median(ck_all),
        "plain_step_s": median(pl_all),
        "overhead_pct": 100.0 * (median(ratios) - 1.0),
        "pooled_overhead_pct": 100.0 * (median(ck_all) / median(pl_all) - 1.0),
        "block_overheads_pct": overheads,
        "median_interval_pct": median_interval(overheads),
        "median_verdict": median_verdict(overheads, TARGET_PCT),
        "intervals_per_block": [len(a) for a, _ in per_block],
        # what a side burns while the other has its turn (CPU seconds per second, sampled every 0.25 s): ckptless_hpc's
        # heartbeats, coordinator and spares go on then and slow the plain side's turn, a bias in ckptless_hpc's favour of at most about this over 2 cores
        "ckptless_cores_while_parked": _cores_within(j.cpu_samples or [], turns[pl_gate], lambda cmd: True),
        "plain_cores_while_parked": _cores_within(b.cpu_samples, turns[ck_gate], _is_plain_rank),
        "ckptless_final_loss": j.summary.get("final_loss"),
        "plain_final_loss": b.final_loss(),
        "ckptless_run": j.run_dir.name,
        "elapsed_s": time.monotonic() - t0,
    }


def measure_interleaved(plan_name: str, blocks: int, block: int, tmp: Optional[Path] = None, modes: Sequence[str] = ("tp", "pp"), extra: Sequence[str] = ()) -> Dict[str, Any]:
    """The step comparison of TP and PP (or of ``modes``), interleaved (no recoveries: the section's other runs measure them)."""
    plan = PLANS[plan_name]
    runs = _Runs(tmp or RESULTS / "tmp" / "parallel")
    runs.tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    log(f"{plan.name} interleaved: LlamaParallelTask {plan.task}, 2 replicas x 2 ranks, both sides alive, {blocks} turns of {block} steps each (first {plan.skip_steps} steps skipped)")
    out: Dict[str, Any] = {"plan": plan.name, "task": TASK, "sizes": dict(plan.task), **model_figures(plan.task), "replicas": 2, "world": 4, "target_pct": TARGET_PCT,
                           "pp_schedule": "gpipe", "pp_micro_batches": plan.micro_batches, "skip_steps": plan.skip_steps, "ckptless_extra": list(extra)}  # fmt: skip
    for mode in modes:
        out[mode] = interleaved(runs, plan, mode, blocks, block, extra)
    out["elapsed_s"] = time.monotonic() - t0
    return out


def pool_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Several interleaved runs (``measure_interleaved``'s, one after the other) as one: per layout
    the median and its interval over every run's turns together, and each run's own median. One
    run's interval covers the noise within it; the load of a shared machine also moves between
    runs, which only several runs sample."""
    out = {k: v for k, v in runs[0].items() if k not in ("tp", "pp", "elapsed_s", "source")}
    out["elapsed_s"] = sum(r["elapsed_s"] for r in runs)
    for mode in ("tp", "pp"):
        each = [r[mode] for r in runs if mode in r]
        if not each:
            continue
        turns = [x for s in each for x in s["block_overheads_pct"]]
        out[mode] = {
            **each[-1],  # the last run's losses and run name
            "blocks": len(turns),
            "ckptless_step_s": median([s["ckptless_step_s"] for s in each]),
            "plain_step_s": median([s["plain_step_s"] for s in each]),
            "overhead_pct": median(turns),
            "pooled_overhead_pct": median([s["pooled_overhead_pct"] for s in each]),
            "block_overheads_pct": turns,
            "median_interval_pct": median_interval(turns),
            "median_verdict": median_verdict(turns, TARGET_PCT),
            "intervals_per_block": [n for s in each for n in s["intervals_per_block"]],
            "ckptless_cores_while_parked": median([s["ckptless_cores_while_parked"] for s in each]),
            "plain_cores_while_parked": median([s["plain_cores_while_parked"] for s in each]),
            # a pooled result among them (an older file) brings its own runs' figures
            "runs_overhead_pct": [x for s in each for x in s.get("runs_overhead_pct", [s["overhead_pct"]])],
            "runs_median_interval_pct": [x for s in each for x in s.get("runs_median_interval_pct", [s["median_interval_pct"]])],
            "elapsed_s": sum(s["elapsed_s"] for s in each),
        }
        out[mode]["runs"] = len(out[mode]["runs_overhead_pct"])
    return out


def pool_files(paths: Sequence[Path]) -> Dict[str, Any]:
    """Interleaved results written by earlier runs (``--interleave``, with or without ``--repeat``) pooled as
    :func:`pool_runs` pools the runs of one command: they must be of the same plan and turn length."""
    runs: List[Dict[str, Any]] = []
    for path in paths:
        res = json.loads(Path(path).read_text(encoding="utf-8"))
        got = res.get("interleaved_runs") or ([res["interleaved"]] if "interleaved" in res else [])
        if not got:
            raise BenchError(f"{path}: no interleaved figures. HINT: files written by --interleave")
        for r in got:
            r["source"] = f"{Path(path).name} (core {res.get('machine', {}).get('core_commit')})"
        runs += got
    keys = {(r["plan"], r["sizes"].get("seq_len"), r["sizes"].get("batch_size"), next(r[m]["block_steps"] for m in ("tp", "pp") if m in r)) for r in runs}
    if len(keys) > 1:
        raise BenchError(f"the files measured different things (plan, seq_len, batch_size, steps per turn): {sorted(keys)}. HINT: pool runs of one command line")
    out = pool_runs(runs)
    out["sources"] = list(dict.fromkeys(r["source"] for r in runs))  # each file once, in order
    return out


def _layouts(res: Dict[str, Any]) -> List[Tuple[str, str]]:
    """The layouts ``res`` holds (an interleaved run may have measured one of them)."""
    return [(m, n) for m, n in (("tp", "TP=2 x 2 replicas"), ("pp", f"PP=2 x 2 (gpipe, {res['pp_micro_batches']} mb)")) if m in res]


def _model(res: Dict[str, Any]) -> str:
    return f"{res['task'].rsplit('.', 1)[-1]} {res['sizes']}, {res['params'] / 1e6:.2f} M parameters"


def _cores(x: Optional[float]) -> str:
    return "n/a" if x is None or x != x else f"{x:.3f}"


def table_interleaved(res: Dict[str, Any]) -> str:
    """The interleaved step comparison as text."""
    lines = [
        f"Tensor and pipeline parallel (issue 31), interleaved: {_model(res)}; 2 replicas x 2 ranks; a ckptless_hpc job and a plain run alive at once, taking turns of {res[_layouts(res)[0][0]]['block_steps']} steps"
        + (f"; the ckptless_hpc side with {' '.join(res['ckptless_extra'])}" if res.get("ckptless_extra") else ""),
        f"{'layout':<32}{'ckptless ms/step':>18}{'plain ms/step':>15}{'overhead':>10}{'pooled':>9}  {'interval of the median':<34}<= {res['target_pct']}%?",
    ]
    for mode, name in _layouts(res):
        s = res[mode]
        ci = s["median_interval_pct"]
        span = f"{ci['coverage']:.0%} {_pct(ci['low'])} .. {_pct(ci['high'])} ({ci['n']} turns)" if ci.get("coverage") is not None else f"n/a ({ci.get('n')} turns)"
        if s.get("runs_overhead_pct"):
            name = f"{name}, {s['runs']} run{'s' if s['runs'] > 1 else ''}"
        lines.append(f"{name:<32}{_ms(s['ckptless_step_s']):>18}{_ms(s['plain_step_s']):>15}{_pct(s['overhead_pct']):>10}{_pct(s['pooled_overhead_pct']):>9}  {span:<34}{s['median_verdict']}")
    for mode, _ in _layouts(res):
        s = res[mode]
        for i, (o, ci) in enumerate(zip(s.get("runs_overhead_pct", []), s.get("runs_median_interval_pct", []))):
            lines.append(f"  {mode.upper()} run {i + 1}: median {_pct(o)}, {_pct(ci.get('low'))} .. {_pct(ci.get('high'))}")
        lines.append(f"{mode.upper()} while the other side has its turn: the ckptless_hpc job burns {_cores(s['ckptless_cores_while_parked'])} cores, the plain run {_cores(s['plain_cores_while_parked'])}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ report
def headline(res: Optional[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """The section's figures for ``python -m bench``'s headline (None where the section did not run or failed)."""
    ok = bool(res) and "tp" in res and "recovery" in res  # type: ignore[operator]
    r = res["recovery"] if ok else {}  # type: ignore[index]
    return {
        "tp_overhead_pct": _f(res["tp"]["overhead_pct"]) if ok else None,  # type: ignore[index]
        "pp_overhead_pct": _f(res["pp"]["overhead_pct"]) if ok else None,  # type: ignore[index]
        "tp_downtime_s": _f(r["tp"]["downtime_s"]) if ok else None,
        "pp_downtime_s": _f(r["pp"]["downtime_s"]) if ok else None,
        "ddp_downtime_s": _f(r["ddp"]["downtime_s"]) if ok else None,
        "ddp_whole_downtime_s": _f(r["ddp_whole"]["downtime_s"]) if ok else None,
        "tp_bytes_ratio_vs_ddp": _f(r["tp"]["bytes_ratio_vs_ddp"]) if ok else None,
        "pp_bytes_ratio_vs_ddp": _f(r["pp"]["bytes_ratio_vs_ddp"]) if ok else None,
        "tp_bytes_ratio_vs_ddp_params_first": _f(r["tp"]["bytes_ratio_vs_ddp_params_first"]) if ok else None,
        "pp_bytes_ratio_vs_ddp_params_first": _f(r["pp"]["bytes_ratio_vs_ddp_params_first"]) if ok else None,
    }


def _ms(x: Optional[float], digits: int = 1) -> str:
    return "n/a" if x is None or x != x else f"{1e3 * x:.{digits}f}"


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None or x != x else f"{x:+.1f}%"


def table(res: Dict[str, Any]) -> str:
    """The section as text: the step pairs, then the recoveries."""
    lines = [
        f"Tensor and pipeline parallel (issue 31): {_model(res)}; 2 replicas x 2 ranks + 1 spare node; "
        f"{res['steps']} steps (first {res['skip_steps']} skipped), {res['pairs']} back-to-back pair(s) per layout",
        f"{'layout':<22}{'ckptless ms/step':>18}{'plain ms/step':>15}{'overhead':>10}  {'pairs':<28}{'<= ' + str(res['target_pct']) + '%?':<26}{'CPU/step vs plain: ranks, whole job':>36}",
    ]
    for mode, name in _layouts(res):
        s = res[mode]
        pairs = ", ".join(_pct(x) for x in s["pair_overheads_pct"])
        lines.append(
            f"{name:<22}{_ms(s['ckptless_step_s']):>18}{_ms(s['plain_step_s']):>15}{_pct(s['overhead_pct']):>10}  {pairs:<28}{s['verdict']:<26}{_pct(s['cpu_overhead_pct']) + ', ' + _pct(s['cpu_overhead_all_pct']):>36}"
        )
    for mode in ("tp", "pp"):
        ci = res[mode].get("median_interval_pct") or {}
        if ci.get("coverage") is not None:
            lines.append(
                f"{mode.upper()} median over {ci['n']} pairs: {ci['coverage']:.0%} interval {_pct(ci['low'])} .. {_pct(ci['high'])}: "
                f"<= {res['target_pct']}%? {res[mode]['median_verdict']}"
            )
    f = res["fault"]
    lines += [
        "",
        f"Recovery: {f['kind']} of rank {f['rank']} (replica 1) at step {f['step']}; a spare takes the rank, its state fetched from the survivors that hold it (TP, PP: the same coordinate of replica 0)",
        f"{'mode':<26}{'downtime s':>11}{'detect':>8}{'reconf':>8}{'transfer':>10}{'resume':>8}{'MB moved':>10}{'vs ddp whole':>14}{'step ms':>9}  bitwise",
    ]
    names = {"tp": "TP=2 (rank: TP coord 1)", "pp": "PP=2 (rank: stage 1)", "ddp": "ddp (parameters first)", "ddp_whole": "ddp (whole state first)"}
    for mode in RECOVERY_MODES:
        r = res["recovery"][mode]
        ratio = f"{r['bytes_ratio_vs_ddp']:.2f}x" if "bytes_ratio_vs_ddp" in r else ""
        lines.append(
            f"{names[mode]:<26}{r['downtime_s']:>11.2f}{r['detect_s']:>8.2f}{r['reconfigure_s']:>8.2f}{r['transfer_s']:>10.3f}{r['resume_s']:>8.2f}"
            f"{r['bytes_transferred'] / 1e6:>10.2f}{ratio:>14}{_ms(r['step_s']):>9}  {'yes' if r['oracle'] else 'NO'}"
        )
    lines.append(
        f"(MB moved: before the redone step, summary.json bytes_transferred; the whole training state is {res['state_bytes'] / 1e6:.2f} MB of fp32 "
        "parameters and AdamW moments; ddp's default moves the parameters first and the moments behind the step)"
    )
    return "\n".join(lines)


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return _f(x)
    return x


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.parallel_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the smoke variant: the task's tiny sizes, one pair, a few steps")
    ap.add_argument("--plan", choices=sorted(PLANS), help="a plan by name (--quick is --plan quick; default full); tokens: 8x the tokens per step")
    ap.add_argument("--pairs", type=int, help="back-to-back pairs per layout in place of the plan's (5 or more: the median's interval gives a verdict)")
    ap.add_argument("--interleave", type=int, metavar="TURNS", help="the step comparison only, both sides alive at once taking TURNS turns each (bench/gate.py); no recoveries")
    ap.add_argument("--block", type=int, default=5, metavar="STEPS", help="--interleave: steps per turn (default 5; the first of each is not counted)")
    ap.add_argument("--repeat", type=int, default=1, metavar="RUNS", help="--interleave: RUNS interleaved runs one after the other, their turns pooled (the load moves between runs too)")
    ap.add_argument("--pool", nargs="+", type=Path, metavar="JSON", help="no run: the interleaved results in these files pooled into one (writes DIR/only-parallel-interleaved-pooled.json)")
    ap.add_argument("--layouts", default="tp,pp", help="--interleave: the layouts to measure, comma-separated (default tp,pp)")
    ap.add_argument("--ckptless-set", action="append", default=[], metavar="KEY=VALUE", help="--interleave: an override of the ckptless_hpc side only, to find which of its costs a figure holds (repeatable)")
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"results folder (default {RESULTS.relative_to(REPO)}); run directories in DIR/tmp/parallel")
    args = ap.parse_args(argv)
    results = args.results.resolve()
    if args.pool:
        pooled = pool_files(args.pool)
        path = results / "only-parallel-interleaved-pooled.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        command = "python -m bench.parallel_bench --pool " + " ".join(str(p) for p in args.pool)
        path.write_text(json.dumps(_clean({"command": command, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "interleaved": pooled}), indent=2) + "\n", encoding="utf-8")
        print(table_interleaved(pooled))
        print("\n".join(["", "sources:", *pooled["sources"], f"wrote {path}"]))
        return 0
    plan = args.plan or ("quick" if args.quick else "full")
    if args.pairs is not None and args.pairs < 1:
        ap.error(f"--pairs {args.pairs}: at least 1")
    if args.interleave is not None and (args.interleave < 1 or args.block < 2 or args.pairs is not None):
        ap.error(f"--interleave {args.interleave} --block {args.block}: at least 1 turn of at least 2 steps, and no --pairs (the turns are the pairs)")
    if args.repeat < 1 or (args.repeat > 1 and args.interleave is None):
        ap.error(f"--repeat {args.repeat}: at least 1, and more than 1 with --interleave only")
    layouts = [m.strip() for m in args.layouts.split(",") if m.strip()]
    if not layouts or any(m not in ("tp", "pp") for m in layouts) or ((args.layouts != "tp,pp" or args.ckptless_set) and args.interleave is None):
        ap.error(f"--layouts {args.layouts!r} --ckptless-set {args.ckptless_set}: layouts among tp,pp, and both options with --interleave only")
    command = (
        "python -m bench.parallel_bench"
        + (" --quick" if args.quick else f" --plan {plan}" if args.plan else "")
        + (f" --pairs {args.pairs}" if args.pairs is not None else "")
        + (f" --interleave {args.interleave} --block {args.block}" if args.interleave is not None else "")
        + (f" --repeat {args.repeat}" if args.repeat > 1 else "")
        + (f" --layouts {','.join(layouts)}" if layouts != ["tp", "pp"] else "")
        + "".join(f" --ckptless-set {x}" for x in args.ckptless_set)
        + ("" if results == RESULTS else f" --results {args.results}")
    )
    res: Dict[str, Any] = {
        "mode": plan,
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),  # the package's git commit (core_commit) and the load average at the start
    }
    if args.interleave is not None:
        runs = [measure_interleaved(plan, args.interleave, args.block, results / "tmp" / "parallel", layouts, args.ckptless_set) for _ in range(args.repeat)]
        res["interleaved"] = runs[0] if args.repeat == 1 else pool_runs(runs)
        if args.repeat > 1:
            res["interleaved_runs"] = runs  # each run's own figures (--pool pools them with other files' runs)
        res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        tag = "".join(f"-{m}" for m in layouts if layouts != ["tp", "pp"]) + ("-set" if args.ckptless_set else "") + (f"-{args.repeat}runs" if args.repeat > 1 else "")
        path = results / f"{'quick' if plan == 'quick' else 'only'}-parallel-{plan}-interleaved{tag}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_clean(res), indent=2) + "\n", encoding="utf-8")
        print(table_interleaved(res["interleaved"]))
        print(f"\nload average at start {res['machine']['loadavg_at_start']}, at end {res['machine']['loadavg_at_end']}; wrote {path}")
        return 0
    res["parallel"] = measure(plan == "quick", results / "tmp" / "parallel", plan, args.pairs)
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    res["headline"] = headline(res["parallel"])
    res["elapsed_s"] = res["parallel"]["elapsed_s"]
    path = results / ({"quick": "quick-parallel.json", "full": "only-parallel.json"}.get(plan, f"only-parallel-{plan}.json") if args.pairs is None else f"only-parallel-{plan}-{args.pairs}pairs.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(res), indent=2) + "\n", encoding="utf-8")
    print(table(res["parallel"]))
    print(f"\nload average at start {res['machine']['loadavg_at_start']}, at end {res['machine']['loadavg_at_end']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
