"""Watching a submitted job from outside, as a user (or a test) would: submit it with the CLI,
read its run dir's events as they arrive, wait for one, wait for the job to leave the queue,
and say what Slurm and the run show when a wait times out.

Shared by the real-Slurm tests (tests/slurm) and ``python -m ckptless_hpc.chaos cluster=slurm``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..rundir.events import read_events, split_attempts
from ..rundir.paths import LOGS, SUBMITIT, RunPaths
from . import commands

Event = Dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
QUEUED = ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING")


class WaitTimeout(AssertionError):
    """A wait ran out; the message names what was awaited and what Slurm and the run showed
    then (an AssertionError, so that a test reports it as the expectation that failed)."""


def wait_for(what: str, condition: Callable[[], Any], within_s: float, poll_s: float = 0.1, diagnose: Optional[Callable[[], str]] = None) -> Any:
    """Poll ``condition`` until it returns something truthy (returned), or raise WaitTimeout
    naming ``what`` (with what ``diagnose`` says about the state of things at that moment)."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {within_s} s waiting for {what}" + (f"\n{diagnose()}" if diagnose else ""))
        time.sleep(poll_s)


def events(run_dir: Path) -> List[Event]:
    """Every event so far (all attempts); [] before the coordinator started."""
    return read_events(str(run_dir))


def wait_event(run_dir: Path, pred: Callable[[Event], bool], what: str, within_s: float = 120) -> Event:
    return wait_for(what, lambda: next((e for e in events(run_dir) if pred(e)), None), within_s, diagnose=lambda: diagnose(run_dir))


def submit(run_dir: Path, *overrides: str, timeout_s: float = 120) -> str:
    """``python -m ckptless_hpc cluster=slurm hydra.run.dir=RUN_DIR ...``; the job id."""
    cmd = [sys.executable, "-m", "ckptless_hpc", "cluster=slurm", f"hydra.run.dir={run_dir}", *overrides]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    if p.returncode != 0 or "submitted Slurm job" not in p.stdout:
        raise RuntimeError(f"submitting failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stdout}{p.stderr}")
    return str(json.loads(Path(RunPaths(str(run_dir)).job).read_text())["job_id"])


def in_queue(job_id: str) -> bool:
    return commands.job_state(job_id) in QUEUED


def finished(job_id: str, run_dir: Path, within_s: float = 180) -> Dict[str, Any]:
    """Wait until the job leaves the queue; its summary.json."""
    wait_for(f"job {job_id} to leave the queue", lambda: not in_queue(job_id), within_s, poll_s=0.5, diagnose=lambda: diagnose(run_dir))
    return json.loads(Path(RunPaths(str(run_dir)).summary).read_text())


def batch_host(job_id: str) -> str:
    """The node running the job's batch step (the coordinator's node)."""
    return commands.run(["squeue", "-h", "-j", job_id, "-o", "%B"]).stdout.strip()


def current_ranks(evs: Sequence[Event]) -> Dict[int, str]:
    """rank -> worker of the latest generation of the latest attempt ({} before generation 0)."""
    ranks: Dict[int, str] = {}
    for e in split_attempts(evs)[-1] if evs else []:
        if e.get("event") in ("generation_started", "reformed") and isinstance(e.get("ranks"), dict):
            ranks = {int(r): str(w) for r, w in e["ranks"].items()}
    return ranks


def first_ranks(run_dir: Path) -> Dict[int, str]:
    """rank -> worker of generation 0 (waits for it)."""
    started = wait_event(run_dir, lambda e: e["event"] == "generation_started", "generation 0")
    return {int(r): w for r, w in started["ranks"].items()}


def attempt_start(evs: Sequence[Event], attempt: int) -> Optional[Event]:
    """The first generation of attempt ``attempt`` (0: the first run, 1: after one requeue)."""
    atts = split_attempts(evs) if evs else []
    if len(atts) <= attempt:
        return None
    return next((e for e in atts[attempt] if e.get("event") == "generation_started"), None)


def diagnose(run_dir: Path) -> str:
    """What Slurm and the run say when a wait times out (CI shows only the failure)."""
    run_dir = Path(run_dir)
    out = []
    for argv in (["squeue", "-a", "-o", "%i %T %r %N %B"], ["sinfo", "-N", "-o", "%N %T %E"], ["scontrol", "-o", "show", "job"]):
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
            out.append(f"$ {' '.join(argv)}\n{(p.stdout + p.stderr).strip()}")
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"$ {' '.join(argv)}: {e}")
    ev = events(run_dir)
    out.append("last events:\n" + "\n".join(json.dumps(e) for e in ev[-12:] if e.get("event") != "step"))
    for log in sorted(run_dir.glob("*.log")) + sorted(run_dir.glob(f"{LOGS}/*.log")) + sorted(run_dir.glob(f"{SUBMITIT}/*.err")):
        lines = log.read_text(errors="replace").splitlines()
        if lines:
            out.append(f"--- {log.relative_to(run_dir)} (last 8 lines)\n" + "\n".join(lines[-8:]))
    return "\n".join(out)[-12000:]
