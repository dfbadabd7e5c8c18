"""The run record the coordinator keeps: events.jsonl, restart.json (what a requeued job needs),
summary.json, and the bookkeeping of what was saved (the emergency copy, its shards, the final
save, the periodic copies). A write that fails is said once and never raised (rundir/record.py).
No decisions here: what the summary says is gathered by the shell and written once."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ..config import fault_list
from ..metrics import Degraded, Recovery, goodput
from ..rundir.events import EventLog
from ..rundir.paths import RunPaths
from ..rundir.record import Failures, RecordError, write_json
from ..rundir.restart import Restart, write as write_restart
from .saved_copies import SavedCopies


class RunRecord:
    def __init__(self, run_dir: str, job_id: str, clock: Callable[[], float], copies: SavedCopies) -> None:
        self.run_dir, self.job_id, self.clock = run_dir, job_id, clock
        self.paths = RunPaths(run_dir)  # every file of the run directory (rundir/paths.py)
        self.failures = Failures()  # the run record's writes that failed (record.py): said once, never raised
        self.events = EventLog(self.paths.events, job_id, clock, on_error=self.failures.report)
        self.copies = copies  # train.save_every
        self.t_start, self.t_train = clock(), None  # type: float, Optional[float]
        self.saved: Optional[Dict[str, Any]] = None  # the emergency copy
        self.shard_saves: Dict[int, Dict[str, Any]] = {}  # sharded emergency copy (or a final save): shard -> its file
        self.save_error: Optional[str] = None  # the emergency copy could not be written (why)
        self.final: Optional[Dict[str, Any]] = None  # train.save_final: what the final save wrote
        self.resume: Optional[Dict[str, Any]] = None  # emergency copy to start from (after a requeue)
        self.recoveries: List[Recovery] = []
        self.moves: List[Recovery] = []  # planned moves (coordinator/moves.py): drains, stragglers replaced, grow-backs
        self.degraded = Degraded()  # a job that shrank: when it trained with fewer processes than ranks
        self.summary: Dict[str, Any] = {}

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str, job_id: str, clock: Callable[[], float], shards: int, mode: str) -> "RunRecord":
        return cls(run_dir, job_id, clock, SavedCopies(run_dir, shards, int(cfg.train.get("keep_saved", 2)), mode))

    def newest_copy(self) -> Optional[Dict[str, Any]]:
        """The newest copy a restarted job may resume from: the emergency copy, a periodic one, the one resumed from."""
        return max((c for c in (self.saved, self.copies.newest, self.resume) if c), key=lambda c: c["step"], default=None)

    def persist(self, bad_nodes: Any, faults_done: Any, batch_node: Optional[str]) -> None:
        """What a requeued job needs: the emergency copy, nodes never to use again, faults fired.
        A write that fails is said once and leaves the previous restart.json as it was."""
        try:
            write_restart(self.run_dir, Restart.of(self.newest_copy(), bad_nodes, faults_done, batch_node))
        except RecordError as e:
            self.failures.report(e.path, f"{e}; a requeued job would resume from what it said before")

    def restore(self, state: Dict[str, Any]) -> Restart:
        """A previous run's restart.json (after a requeue): its copy becomes the one to resume from."""
        r = Restart.from_json(state)
        self.resume = r.saved or self.resume
        return r

    def write_summary(self, summary: Dict[str, Any]) -> None:
        self.summary = summary
        try:
            write_json(self.paths.summary, summary)
        except RecordError as e:  # the job's own exit code stands: the result goes to the console (run.human_summary)
            self.failures.report(e.path, str(e))
            summary["record_errors"] = self.failures.messages

    def timing(self, productive: float) -> Dict[str, float]:
        """startup_s, wall_s, productive_s, goodput: measured from the start of training."""
        now = self.clock()
        t_train = self.t_train or now
        wall = now - t_train
        return {"startup_s": round(t_train - self.t_start, 3), "wall_s": round(wall, 3), "productive_s": round(productive, 3), "goodput": round(goodput(productive, wall), 4)}


def log_tail(path: str, lines: int = 30) -> str:
    """The last lines of a worker's log (what a start-up failure's error quotes)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def summary(
    r: RunRecord, code: int, status: str, error: Optional[str], final_sha: Optional[str], final: Optional[Dict[str, Any]], cfg: Any, job: Any, t: Any, h: Any
) -> Dict[str, Any]:
    """summary.json: how the job ended, its figures, what it saved; ``job``: the job machine,
    ``t``: the telemetry (steps, metrics), ``h``: the health (heartbeat delays, stalls)."""
    return {
        "job": r.job_id,
        "status": status,
        "exit_code": code,
        "error": error,
        "steps_completed": t.steps.last_step or 0,
        "steps_requested": cfg.train.steps,
        "final_state_sha256": final_sha,
        "final": final,  # train.save_final: the model file and the state folder, with their sha256
        "world_size": job.world,
        "workers": f"{len(job.members.ranks)}/{job.world}" + (" (degraded)" if job.vacant else ""),
        "degraded": r.degraded.report(r.clock(), t.steps.last_step or 0),
        "generations": job.gen + 1,
        **r.timing(t.steps.productive_s),
        "final_loss": t.steps.last_loss,
        "final_metrics": t.last_metrics,  # the task's own, of the last step
        "eval": t.last_eval,  # the last evaluation: {"step", "metrics"}
        "faults": fault_list(cfg.fault),
        "faults_fired": sorted(job.faults_done),
        "excluded_nodes": sorted(job.members.bad_nodes),
        "recoveries": [x.report() for x in r.recoveries],
        "moves": [x.report() for x in r.moves],
        "heartbeat_delay": h.hb_delay.report(),  # the workers' clocks against ours: exact on one machine only
        "coordinator_stalls": {"total_s": round(h.stalls.stalled_s, 3), "worst_s": round(h.stalls.worst_s, 3)},
        "skipped_steps": dict(t.skipped),
        "saved_state": r.saved,
        "parallel": layout_summary(job),
        "resumed_from": r.resume,
        "run_dir": r.run_dir,
        "record_errors": r.failures.messages,  # files of the run record that could not be written (record.py)
    }


def layout_summary(job: Any) -> Dict[str, Any]:
    layout, workers = job.layout, job.members.workers
    out: Dict[str, Any] = {"mode": layout.mode, "survives_node_losses": layout.survives()}
    if layout.sharded:
        done = job.g(job.gen).done
        out["copies_bytes_by_rank"] = {str(workers[w].rank): m.copies_bytes for w, m in sorted(done.items()) if m.copies_bytes is not None}
        out["copy_costs_by_rank"] = {str(workers[w].rank): m.copy_costs for w, m in sorted(done.items()) if m.copy_costs is not None}
    return out
