"""B1 on the real Slurm path: a crashed worker node and a killed worker step on the mini-cluster.

The Slurm mini-cluster of the tests (tests/slurm_cluster/up.sh: munge, slurmctld and 4 slurmd on
this machine, root only) runs a real job (`python -m ckptless_hpc cluster=slurm`, submitit, one
srun step per node). After step ``fault_step`` the harness fails rank 1's node from outside:

- ``crash``: ``down.sh --crash-node`` SIGKILLs the node's slurmd, slurmstepd and tasks in one
  instant (its sockets close, so the coordinator sees the control connection end at once);
- ``step``: ``scancel`` of the node's worker step (SIGKILL of its tasks through Slurm).

Downtime is measured from the fault (down.sh's own "crashed at" stamp; the instant before the
scancel) to the first step committed by the whole world after it (the summary's ``t_resumed``),
on one clock. Next to it the phases of the summary and the ``scheduler_command`` events (the
scancel of the dead step: how long slurmctld took to answer), and, as the reference, the local
killed worker of the same model (``fault=kill_worker``, its downtime from the self-kill).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ckptless_hpc.slurm import minicluster, watch

from .common import REPO, BenchError, JobRun, median, read_jsonl, task_overrides

NODES = 4  # the mini-cluster's size: 2 worker nodes, 1 spare, 1 free
POLL_S = 0.02
TARGET_S = 0.5  # the target: within 0.5 s of the local killed worker's downtime


def ensure_cluster() -> tuple:
    """(env for Slurm commands, None) or (None, why the cluster cannot run here)."""
    try:
        return dict(os.environ, **minicluster.ensure_cluster(NODES)), None
    except minicluster.ClusterError as e:
        return None, f"skipped: {e}"[:800]


def _wait(what: str, probe: Callable[[], Any], within_s: float, run_dir: Path) -> Any:
    try:
        return watch.wait_for(what, probe, within_s, poll_s=POLL_S)
    except watch.WaitTimeout as e:
        raise BenchError(f"{e} in {run_dir}; see {run_dir}/coordinator.log") from None


def _first(run_dir: Path, pred: Callable[[Dict[str, Any]], bool]) -> Optional[Dict[str, Any]]:
    return next((e for e in read_jsonl(run_dir / "events.jsonl") if pred(e)), None)


def crash_time(down_sh_output: str) -> float:
    """The instant down.sh sent SIGKILL (its "crashed at <unix seconds>" line)."""
    m = re.search(r"crashed at (\d+\.\d+)", down_sh_output)
    if m is None:
        raise BenchError(f"down.sh did not say when it crashed the node:\n{down_sh_output[-1000:]}")
    return float(m.group(1))


def point(kind: str, run: JobRun, t_fault: float, node: str) -> Dict[str, Any]:
    """One faulted Slurm run: downtime from the fault, the summary's phases, the scancel's cost."""
    (rec,) = run.summary["recoveries"]
    cancel = next((e for e in run.of("scheduler_command") if e["action"] == "cancel_step" and e.get("node") == node), None)
    promoted = next(e for e in run.of("spare_promoted"))
    return {
        "kind": kind,
        "run_dir": str(run.run_dir),
        "node": node,
        "downtime_s": rec["t_resumed"] - t_fault,  # from the fault itself, not from its detection
        "fault_to_detect_s": rec["t_detect"] - t_fault,
        **{k: rec[k] for k in ("detect_s", "reconfigure_s", "transfer_s", "resume_s", "bytes_transferred")},
        "summary_downtime_s": rec["downtime_s"],  # from the detection (no injected fault to date it)
        "scancel_s": None if cancel is None else cancel["seconds"],
        "scancel_after_promotion": None if cancel is None else cancel["started_at"] >= promoted["time"],
        "coordinator_worst_stall_s": run.summary["coordinator_stalls"]["worst_s"],
        "final_state_sha256": run.summary["final_state_sha256"],
        "step_s": median(run.step_intervals(skip=1)),
    }


class SlurmRuns:
    """Submits jobs to the mini-cluster and fails a node of each (see the module docstring)."""

    def __init__(self, env: Dict[str, str], size: str, steps: int, fault_step: int) -> None:
        from ckptless_hpc.slurm import commands

        self.commands = commands
        self.env = env
        self.cluster = minicluster
        self.overrides = task_overrides(size) + ["cluster.refill_spares=false", f"train.steps={steps}", "train.log_every=1000000"]
        self.fault_step = fault_step

    def _submit(self, run_dir: Path, extra: List[str]) -> str:
        cmd = [sys.executable, "-m", "ckptless_hpc", "cluster=slurm", f"hydra.run.dir={run_dir}", *self.overrides, *extra]
        p = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise BenchError(f"submission failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
        return json.loads((run_dir / "job.json").read_text())["job_id"]

    def _finish(self, job: str, run_dir: Path, t0: float) -> JobRun:
        live = ("PENDING", "RUNNING", "COMPLETING", "REQUEUED")
        _wait(f"job {job} to end", lambda: self.commands.job_state(job, env=self.env) not in live, 300, run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary["status"] != "completed":
            raise BenchError(f"job {job} ended {summary['status']}: {summary.get('error')}; see {run_dir}")
        return JobRun(run_dir, summary, read_jsonl(run_dir / "events.jsonl"), time.monotonic() - t0)

    def fault_free(self, run_dir: Path) -> JobRun:
        t0 = time.monotonic()
        return self._finish(self._submit(run_dir, []), run_dir, t0)

    def faulted(self, kind: str, run_dir: Path) -> Dict[str, Any]:
        t0 = time.monotonic()
        job = self._submit(run_dir, [])
        try:
            started = _wait("generation 0", lambda: _first(run_dir, lambda e: e["event"] == "generation_started"), 180, run_dir)
            victim = started["ranks"]["1"]
            node = victim.rpartition(".")[0]
            _wait(f"step {self.fault_step}", lambda: _first(run_dir, lambda e: e["event"] == "step" and e["step"] >= self.fault_step), 180, run_dir)
            if kind == "crash":
                try:
                    t_fault = crash_time(self.cluster.crash_node(node))
                    run = self._finish(job, run_dir, t0)
                finally:
                    self.cluster.start_node(node)
            else:
                step = _first(run_dir, lambda e: e["event"] == "worker_connected" and e["worker"] == victim)["slurm_step"]
                t_fault = time.time()
                self.commands.cancel_step(job, int(step), env=self.env)
                run = self._finish(job, run_dir, t0)
        except BaseException:
            subprocess.run(["scancel", job], env=self.env, capture_output=True, timeout=30, check=False)
            raise
        return point(kind, run, t_fault, node)


def summarize(crash: List[Dict[str, Any]], step: List[Dict[str, Any]], local: List[JobRun], fault_free_sha: str) -> Dict[str, Any]:
    """Medians of each kind next to the local killed worker's downtime (pure)."""

    def med(points: List[Dict[str, Any]]) -> Dict[str, Any]:
        keys = ("downtime_s", "fault_to_detect_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s", "scancel_s", "coordinator_worst_stall_s", "step_s")
        out: Dict[str, Any] = {k: median(p[k] for p in points) for k in keys}
        out["downtimes_s"] = [p["downtime_s"] for p in points]
        out["scancel_after_promotion"] = all(p["scancel_after_promotion"] for p in points if p["scancel_after_promotion"] is not None)
        out["oracle"] = all(p["final_state_sha256"] == fault_free_sha for p in points)
        out["reps"] = len(points)
        return out

    recs = [r.summary["recoveries"][0] for r in local]
    ref = {k: median(rec[k] for rec in recs) for k in ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s")}
    ref["downtimes_s"] = [rec["downtime_s"] for rec in recs]
    c, s = med(crash), med(step)
    return {
        "crash": c,
        "step": s,
        "local_kill": ref,
        "target_s": TARGET_S,
        "crash_over_local_s": c["downtime_s"] - ref["downtime_s"],
        "step_over_local_s": s["downtime_s"] - ref["downtime_s"],
        "points": crash + step,
    }
