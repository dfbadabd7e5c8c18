"""The traditional path, run for real: checkpoint every K steps, and on a failure stop every
process, start them all again, load the checkpoint from disk and redo the lost steps.

The harness plays the part of torchrun's elastic agent or of a Slurm requeue, generously: it
notices a dead worker within milliseconds (it polls the processes every 5 ms), kills the rest
at once and relaunches immediately on the same machine (no scheduler queue, no new
allocation, the checkpoint file still in the page cache). Everything it measures is a lower
bound of what a cluster pays.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import REPO, SIZES, BenchError, CpuSampler, free_port_store, kill_all, read_jsonl

POLL_S = 0.005


@dataclass
class Failure:
    """One failure of the baseline and what the restart cost (seconds from the kill)."""

    index: int
    fault_step: int  # the step being computed when the worker was killed
    ckpt_step: int  # the step of the checkpoint loaded after the restart
    t_fail: float
    detect_s: float  # kill -> the harness sees the exit
    stop_s: float  # -> every other process is gone
    restart_s: float  # -> every new process has imported torch, built the model, formed the group
    load_s: float  # checkpoint read from disk (inside restart_s), slowest rank
    first_step_s: float  # -> first committed step after the restart
    downtime_s: float  # -> first committed step past the failure (lost steps redone)
    lost_steps: int

    def as_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("t_fail")
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


@dataclass
class BaselineRun:
    run_dir: Path
    steps: int
    world: int
    ckpt_every: int
    attempts: int
    failures: List[Failure]
    steps_log: List[Dict[str, Any]]  # rank 0 step events of every attempt, in time order
    save_s: List[float] = field(default_factory=list)
    cpu_samples: Optional[List[tuple]] = None

    def step_intervals(self, skip: int = 5, without_saves: bool = False) -> List[float]:
        """Wall time between consecutive committed steps of one attempt (warm-up skipped);
        ``without_saves`` leaves out the intervals that contain a checkpoint write."""
        out = []
        for a, b in zip(self.steps_log, self.steps_log[1:]):
            if b["step"] == a["step"] + 1 and a["attempt"] == b["attempt"] and a["step"] > skip:
                if without_saves and self.ckpt_every and a["step"] % self.ckpt_every == 0:
                    continue
                out.append(b["t"] - a["t"])
        return out


def _spawn(
    run_dir: Path, attempt: int, store_addr: str, size: str, world: int, steps: int, ckpt: str, ckpt_every: int, faults: List[Dict[str, int]], device: str = "cpu"
) -> List[subprocess.Popen]:
    procs = []
    for r in range(world):
        argv = [
            sys.executable, "-m", "bench.plain_worker", "--rank", str(r), "--world", str(world), "--store", store_addr,
            "--prefix", f"attempt{attempt}", "--task", json.dumps(SIZES[size]), "--steps", str(steps),
            "--ckpt", ckpt, "--ckpt-every", str(ckpt_every), "--faults", json.dumps(faults),
            "--events", str(run_dir / f"a{attempt}.r{r}.jsonl"), "--device", device,
        ]
        log = open(run_dir / f"a{attempt}.r{r}.log", "wb")
        procs.append(subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=_env()))
        log.close()
    return procs


def _env() -> Dict[str, str]:
    import os

    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_baseline(
    run_dir: Path, size: str, world: int, steps: int, ckpt_every: int, faults: List[Dict[str, int]], timeout_s: float = 900, sample_cpu: bool = False,
    device: str = "cpu",
) -> BaselineRun:
    """Train ``steps`` steps with ``world`` plain DDP workers; ``faults``: [{rank, step}, ...];
    ``device="cuda"``: every rank on the one GPU, DDP over gloo (as ckptless' cluster.comm=gloo)."""
    import os

    sampler = CpuSampler(os.getpid()).start() if sample_cpu else None
    try:
        run = _run_baseline(run_dir, size, world, steps, ckpt_every, faults, timeout_s, device)
    finally:
        samples = sampler.stop() if sampler else None
    run.cpu_samples = samples
    return run


def _run_baseline(run_dir: Path, size: str, world: int, steps: int, ckpt_every: int, faults: List[Dict[str, int]], timeout_s: float, device: str = "cpu") -> BaselineRun:
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = str(run_dir / "ckpt.pt") if ckpt_every else ""
    pending = [dict(f, index=i) for i, f in enumerate(faults)]
    store = free_port_store()
    store_addr = f"127.0.0.1:{store.port}"
    deadline = time.monotonic() + timeout_s
    stops: List[Dict[str, float]] = []  # per failure: when the harness saw it and when all were gone
    attempt = 0
    while True:
        procs = _spawn(run_dir, attempt, store_addr, size, world, steps, ckpt, ckpt_every, pending, device)
        while all(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                kill_all(procs)
                raise BenchError(f"baseline in {run_dir} ran past {timeout_s:.0f}s")
            time.sleep(POLL_S)
        t_seen = time.time()
        if all(p.wait() == 0 for p in procs):
            break
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        kill_all(procs)
        t_stopped = time.time()
        fired = [e for r in range(world) for e in read_jsonl(run_dir / f"a{attempt}.r{r}.jsonl") if e["ev"] == "fault"]
        if not fired:
            tail = (run_dir / f"a{attempt}.r{bad[0][0]}.log").read_text(errors="replace")[-2000:] if bad else ""
            raise BenchError(f"baseline worker failed without an injected fault (rank, rc) {bad}:\n{tail}")
        pending = [f for f in pending if f["index"] not in {e["index"] for e in fired}]
        stops.append({"t_fail": min(e["t"] for e in fired), "index": fired[0]["index"], "fault_step": fired[0]["step"], "t_seen": t_seen, "t_stopped": t_stopped})
        attempt += 1
        if attempt > len(faults) + 1:
            raise BenchError(f"baseline in {run_dir}: more restarts than faults")
    return _analyse(run_dir, size, world, steps, ckpt_every, attempt + 1, stops)


def _analyse(run_dir: Path, size: str, world: int, steps: int, ckpt_every: int, attempts: int, stops: List[Dict[str, float]]) -> BaselineRun:
    per = {a: [read_jsonl(run_dir / f"a{a}.r{r}.jsonl") for r in range(world)] for a in range(attempts)}
    steps_log = sorted(
        (dict(e, attempt=a) for a in range(attempts) for e in per[a][0] if e["ev"] == "step"), key=lambda e: e["t"]
    )
    saves = [e["save_s"] for a in range(attempts) for e in per[a][0] if e["ev"] == "ckpt_saved"]
    failures = []
    for i, s in enumerate(stops):
        nxt = per[i + 1]
        ready = [e for rank in nxt for e in rank if e["ev"] == "ready"]
        if len(ready) < world:
            raise BenchError(f"baseline attempt {i + 1} in {run_dir}: only {len(ready)} of {world} ranks became ready")
        ckpt_step = int(ready[0]["step"])
        after = [e for e in steps_log if e["attempt"] > i]
        first = after[0]["t"] if after else float("nan")
        back = next((e["t"] for e in after if e["step"] > s["fault_step"]), float("nan"))
        t_fail = s["t_fail"]
        failures.append(
            Failure(
                index=int(s["index"]), fault_step=int(s["fault_step"]), ckpt_step=ckpt_step, t_fail=t_fail,
                detect_s=s["t_seen"] - t_fail, stop_s=s["t_stopped"] - t_fail, restart_s=max(e["t"] for e in ready) - t_fail,
                load_s=max(e.get("load_s", 0.0) for e in ready), first_step_s=first - t_fail, downtime_s=back - t_fail,
                lost_steps=int(s["fault_step"]) - ckpt_step,
            )
        )
    return BaselineRun(run_dir, steps, world, ckpt_every, attempts, failures, steps_log, saves)


def goodput(steps_log: List[Dict[str, Any]], clean_intervals: List[float]) -> Dict[str, float]:
    """Useful time over wall time: the run's steps at its own undisturbed pace (the mean of
    the intervals that contain no failure, recovery or checkpoint write) over the wall time
    from the start of its first step to its last committed step. Failures, recoveries,
    restarts, redone steps and checkpoint writes are what it loses."""
    if not steps_log or not clean_intervals:
        return {"goodput": float("nan"), "wall_s": float("nan"), "useful_s": float("nan"), "step_ref_s": float("nan")}
    ref = sum(clean_intervals) / len(clean_intervals)
    n = max(e["step"] for e in steps_log)
    wall = steps_log[-1]["t"] - steps_log[0]["t"] + ref  # + the first step itself
    return {"goodput": min(1.0, n * ref / wall), "wall_s": wall, "useful_s": n * ref, "step_ref_s": ref}
