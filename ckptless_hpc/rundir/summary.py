"""summary.json: what a job did, written once when it ends (or is requeued) by the coordinator.

Its shape is declared here, :data:`FIELDS`, every key in the order it is written with what it
says, so that the readers (read.py, the tools, the chaos soak) and the writer share one list;
tests/unit/test_rundir_summary.py pins the coordinator's summary to it. The coordinator still
builds the dict (coordinator/ending.py ``_finish``) and writes it through :func:`write` once its
room adopts it. :func:`read` is the readers' way in.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from .events import RunDirError
from .paths import RunPaths
from .record import write_json

#: Every key of summary.json, in the order written, and what it holds.
FIELDS: Dict[str, str] = {
    "job": "the job id (a Slurm job: its Slurm id)",
    "status": "completed | failed | no_spare | state_lost | nonfinite | final_save_failed | cancelled | startup_failed | requeued",
    "exit_code": "the coordinator's exit code (0: completed)",
    "error": "why it did not complete (None when it did)",
    "steps_completed": "rank 0's last step",
    "steps_requested": "train.steps",
    "final_state_sha256": "the oracle: the sha256 of the final training state",
    "final": "train.save_final: the model file and the state folder, with their sha256",
    "world_size": "ranks",
    "workers": "processes / ranks at the end: '2/3 (degraded)' in a job that shrank and did not grow back (cluster.min_nodes)",
    "degraded": "a job that shrank: {seconds, spans: [{from_step, to_step, processes, seconds}]} trained with fewer processes than ranks",
    "generations": "generations started (1 + recoveries that reformed the world)",
    "startup_s": "from the coordinator's start to generation 0 training",
    "wall_s": "training wall time (after start-up)",
    "productive_s": "seconds in the steps that count (each step once)",
    "goodput": "productive_s / wall_s",
    "final_loss": "rank 0's loss of the last step",
    "final_metrics": "the task's own metrics of the last step",
    "eval": "the last evaluation: {step, metrics}",
    "faults": "the fault schedule (fault=...)",
    "faults_fired": "indices of the schedule's faults that fired, as the workers reported them",
    "excluded_nodes": "nodes never used again",
    "recoveries": "one record per recovery: what failed, what replaced it, each phase's seconds (metrics.Recovery.report)",
    "moves": "one record per planned move (a drain, a straggler replaced, a grow-back: coordinator/moves.py), as a recovery's, with planned: kind, boundary step, reason",
    "heartbeat_delay": "the workers' heartbeat delays against the coordinator's clock (exact on one machine only)",
    "coordinator_stalls": "how long the coordinator's loop stalled: {total_s, worst_s}",
    "skipped_steps": "steps skipped for non-finite values",
    "saved_state": "the emergency copy written, if any (as restart.json keeps it)",
    "parallel": "the layout: mode, the node losses it survives, per-rank copy sizes and costs",
    "resumed_from": "the copy the job started from (resume_from, or a requeue's emergency copy)",
    "run_dir": "the run directory",
    "record_errors": "files of the run record that could not be written (record.py)",
}


def write(run_dir: str, summary: Dict[str, Any]) -> str:
    """Replace ``run_dir``/summary.json with ``summary`` in one step (record.write_json); its path.
    Raises RecordError (the old file untouched) when it cannot."""
    path = RunPaths(run_dir).summary
    write_json(path, summary)
    return path


def read(run_dir: str) -> Optional[Dict[str, Any]]:
    """``run_dir``/summary.json, or None before the job ended; :class:`RunDirError` (with a HINT)
    when it is not JSON."""
    path = RunPaths(run_dir).summary
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path!r} is not valid JSON ({e}). HINT: was it written by ckptless_hpc? it is written once, at the end of a job") from None
