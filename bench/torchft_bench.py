"""B2: TorchFT on the same task, world and kill, if the optional ``torchft`` package is there.

The harness runs TorchFT's Lighthouse in-process, starts one process per replica group,
and when a replica dies restarts it at once (what torchelastic or a Slurm step relaunch does
for TorchFT). Downtime is measured as for ckptless_hpc: from the kill to the first step
committed by the whole world again (``min_replica_size`` = the world size, so the survivor
waits for the replacement, as ckptless_hpc's survivors do).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import REPO, SIZES, BenchError, kill_all, read_jsonl

POLL_S = 0.005


def available() -> Optional[str]:
    """None when torchft imports, else the reason it does not."""
    try:
        import torchft  # noqa: F401
        from torchft.coordination import LighthouseServer  # noqa: F401
    except Exception as e:  # ImportError, or a binary that does not load
        return f"{type(e).__name__}: {e}"
    return None


@dataclass
class TorchFTRun:
    run_dir: Path
    steps: List[Dict[str, Any]]  # replica 0's committed steps, time order
    recovery: Optional[Dict[str, float]]

    def step_intervals(self, skip: int = 5) -> List[float]:
        out = []
        for a, b in zip(self.steps, self.steps[1:]):
            if b["step"] == a["step"] + 1 and a["step"] > skip and (self.recovery is None or not (a["t"] < self.recovery["t_fail"] < b["t"])):
                out.append(b["t"] - a["t"])
        return out


def _spawn(run_dir: Path, replica: int, replicas: int, lighthouse: str, size: str, steps: int, fault_step: int, attempt: int) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "bench.torchft_worker", "--replica", str(replica), "--replicas", str(replicas),
        "--lighthouse", lighthouse, "--task", json.dumps(SIZES[size]), "--steps", str(steps),
        "--fault-step", str(fault_step), "--events", str(run_dir / f"r{replica}.a{attempt}.jsonl"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUST_LOG="warn")
    with open(run_dir / f"r{replica}.a{attempt}.log", "wb") as log:
        return subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)


# The Lighthouse runs in its own process so that its (Rust) log goes to a file.
_LIGHTHOUSE = """
import sys, time
from torchft.coordination import LighthouseServer
lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=int(sys.argv[1]), join_timeout_ms=100)
print(lh.address(), flush=True)
sys.stdin.read()  # until the harness closes our stdin
lh.shutdown()
"""


def _start_lighthouse(run_dir: Path, replicas: int) -> "tuple[subprocess.Popen, str]":
    log = open(run_dir / "lighthouse.log", "wb")
    p = subprocess.Popen([sys.executable, "-c", _LIGHTHOUSE, str(replicas)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    log.close()
    addr = p.stdout.readline().decode().strip()
    if not addr:
        raise BenchError(f"the torchft Lighthouse did not start; see {run_dir}/lighthouse.log")
    return p, addr


def run_torchft(run_dir: Path, size: str, replicas: int, steps: int, fault_replica: Optional[int], fault_step: int, timeout_s: float = 600) -> TorchFTRun:
    run_dir.mkdir(parents=True, exist_ok=True)
    lighthouse, addr = _start_lighthouse(run_dir, replicas)
    procs = {r: _spawn(run_dir, r, replicas, addr, size, steps, fault_step if r == fault_replica else -1, 0) for r in range(replicas)}
    deadline = time.monotonic() + timeout_s
    restarted_at: Optional[float] = None
    seen_at: Optional[float] = None
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                raise BenchError(f"torchft run in {run_dir} ran past {timeout_s:.0f}s")
            for r, p in list(procs.items()):
                rc = p.poll()
                if rc not in (None, 0):
                    if r != fault_replica or restarted_at is not None:
                        tail = (run_dir / f"r{r}.a{1 if restarted_at else 0}.log").read_text(errors="replace")[-2500:]
                        raise BenchError(f"torchft replica {r} exited {rc} unexpectedly:\n{tail}")
                    seen_at = time.time()
                    procs[r] = _spawn(run_dir, r, replicas, addr, size, steps, -1, 1)
                    restarted_at = time.time()
            time.sleep(POLL_S)
    finally:
        kill_all(list(procs.values()))
        lighthouse.stdin.close()
        kill_all([lighthouse])
    ev0 = read_jsonl(run_dir / "r0.a0.jsonl")
    steps_log = [e for e in ev0 if e["ev"] == "step"]
    recovery = None
    if fault_replica is not None:
        fault = [e for e in read_jsonl(run_dir / f"r{fault_replica}.a0.jsonl") if e["ev"] == "fault"]
        repl = read_jsonl(run_dir / f"r{fault_replica}.a1.jsonl")
        if not fault or not repl:
            raise BenchError(f"torchft run in {run_dir}: the fault did not fire or the replacement left no events")
        t_fail = fault[0]["t"]
        first_repl = next(e for e in repl if e["ev"] == "step")
        survivor_next = next((e for e in steps_log if e["t"] > t_fail), None)
        get = {e["ev"]: e for e in repl}
        recovery = {
            "t_fail": t_fail,
            "detect_s": (seen_at or t_fail) - t_fail,
            "relaunch_s": (restarted_at or t_fail) - t_fail,
            "imported_s": get["imported"]["t"] - t_fail,  # process start + import torch, torchft
            "built_s": get["built"]["t"] - t_fail,
            "manager_s": get["ready"]["t"] - t_fail,
            "downtime_s": first_repl["t"] - t_fail,  # the replacement's first committed step
            "survivor_stall_s": (survivor_next["t"] - t_fail) if survivor_next else float("nan"),
            "healed_at_step": first_repl["step"] - 1,
            "fault_step": fault[0]["step"],
        }
    return TorchFTRun(run_dir, steps_log, recovery)
