"""How a job ends: completed (replicas verified), failed, or stopped with its state saved once
(no spare left, preemption, a non-finite step), the messages that decide it (saved, save
failed, non-finite, start-up error), and the summary.json it leaves. Mixed into
``Coordinator``; the decisions it carries out are made there and in membership.py."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Dict, Optional

from ..config import fault_list
from ..metrics import goodput
from ..rundir.record import PRIVATE_DIR_MODE, RecordError, write_failure, write_json
from ..state.placement import plan_shards
from .inbox import Exported, ExportFailed, LoadFailed, Message, NonFinite, PeriodicFailed, PeriodicSaved, Saved, SaveFailed, StartupError
from .membership import WorkerRec
from .sharding import inventories
from .tally import Arrivals

log = logging.getLogger("ckptless_hpc.coordinator")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_SPARE = 3
EXIT_STARTUP = 4
EXIT_REQUEUED = 5
EXIT_CANCELLED = 6
EXIT_NONFINITE = 7


class Ending:
    """The end of a job."""

    def _on_outcome(self, rec: WorkerRec, m: Message) -> None:
        """Messages that end the job one way or another: saved, non-finite, start-up error."""
        if isinstance(m, Saved) and m.shard is not None:  # one shard of a sharded emergency copy
            self.shard_saves[m.shard] = {"path": m.path, "step": m.step, "sha256": m.sha256}
            self._emit("state_saved", rec, step=m.step, path=m.path, shard=m.shard)
        elif isinstance(m, Saved):
            self.saved = {"path": m.path, "step": m.step, "sha256": m.sha256, "bytes": m.bytes, "written": m.written is not False}
            self._emit("state_saved" if m.written is not False else "state_kept", rec, step=m.step, path=m.path, bytes=m.bytes)
        elif isinstance(m, SaveFailed):
            self.save_error = m.error
            self._emit("save_failed", rec, step=m.step, path=m.path, error=m.error)
        elif isinstance(m, PeriodicSaved):
            copy = self.copies.add(m)
            if copy is not None:
                self._emit("state_saved", rec, step=m.step, path=copy["path"], periodic=True)
                self._persist()
        elif isinstance(m, PeriodicFailed):
            self._emit("save_failed", rec, step=m.step, path=m.path, error=m.error, periodic=True)
        elif isinstance(m, Exported):
            self.final = {"model": m.model, "state": m.state, "step": m.step}
            self._emit("final_saved", rec, step=m.step, model=m.model["path"], sha256=m.model["sha256"], state=m.state["path"])
        elif isinstance(m, ExportFailed):
            self.final = {"error": m.error}
            self._emit("save_failed", rec, path=m.path, error=m.error)
        elif isinstance(m, LoadFailed):
            self.fatal = self.fatal or f"the requeued job cannot resume: {m.error}"
            self._emit("load_failed", rec, path=m.path, error=m.error)
        elif isinstance(m, NonFinite):
            if self.nonfinite is None:
                self.nonfinite = {"step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "rank": m.rank, "held": m.held, "worker": rec.wid, "node": rec.node, "skipped": m.skipped}
                self._emit("nonfinite", rec, step=m.step, loss=m.loss, grad_norm=m.grad_norm)
        elif isinstance(m, StartupError):
            self.fatal = f"worker {rec.wid} on node {rec.node} failed at start-up:\n{m.traceback.rstrip()}"

    async def _hold_all(self, survivors: Dict[int, str]) -> Dict[str, Any]:
        """Abort the in-flight step everywhere (a new generation) and collect the committed steps."""
        self.gen += 1
        g = self._g(self.gen)
        self.control.broadcast(survivors.values(), {"type": "abort", "gen": self.gen})
        await self._until(Arrivals(survivors.values(), g.held.__contains__), self.cfg.cluster.recovery_timeout_s)
        return {w: m.step for w, m in g.held.items()}

    async def _save_state(self, survivors: Dict[int, str], held: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Have one rank holding the newest committed step write it to the run directory, once.

        Only a worker holding the job's state reports a step (a spare that never received it
        reports none): a freshly built model is never saved as the job's state."""
        if self.layout.sharded:
            return await self._save_shards()
        steps = {w: s for w, s in held.items() if s is not None}
        if not steps:
            self.save_error = "nothing trained survived (no surviving worker holds the job's state; a spare that never received it holds a fresh model, which is not saved)"
            return None
        target = max(steps.values())
        holder = next(w for r, w in sorted(survivors.items()) if steps.get(w) == target)
        path = os.path.join(self.run_dir, "state", "emergency.pt")
        self.control.send(self.workers[holder], {"type": "stop", "save": path})
        written = await self._until(
            lambda: self.saved is not None or self.save_error is not None or self.workers[holder].role == "dead", self.cfg.cluster.recovery_timeout_s
        )
        if self.saved:
            self._persist()
        elif self.save_error is None:
            why = "it died while writing" if written else f"it did not answer within cluster.recovery_timeout_s={self.cfg.cluster.recovery_timeout_s}s"
            self.save_error = f"rank {self.workers[holder].rank} ({holder}) was asked to write the state of step {target} to {path}, but {why}"
        return self.saved

    async def _save_shards(self) -> Optional[Dict[str, Any]]:
        """A sharded emergency copy: every shard, at the newest step at which every shard is held,
        written once by one worker holding it (its owner, a holder of a copy, a replica). None
        when some shard is held by nobody: a partial copy is never written nor reported."""
        plan, why = plan_shards({}, self.layout.shard_of, inventories(self._g(self.gen).held))
        if plan is None:
            log.error("no emergency copy can be written: %s", why)
            return None
        folder = os.path.join(self.run_dir, "state", f"emergency-step{plan.target_step}")
        writers = {shard: workers[shard % len(workers)] for shard, workers in sorted(plan.holders_at_target.items())}
        if not await self._write_shards(folder, writers, plan.target_step):
            log.error("the sharded emergency copy is incomplete (%d of %d shards written): not used", len(self.shard_saves), len(writers))
            self.save_error = self.save_error or f"the sharded copy is incomplete ({len(self.shard_saves)} of {len(writers)} shards written)"
            return None
        h = hashlib.sha256()
        for shard in sorted(self.shard_saves):
            h.update(f"{shard}:{self.shard_saves[shard]['sha256']};".encode())
        shards = {str(k): {"path": v["path"], "sha256": v["sha256"]} for k, v in sorted(self.shard_saves.items())}
        self.saved = {"path": folder, "step": plan.target_step, "sha256": h.hexdigest(), "shards": shards}
        self._persist()
        return self.saved

    async def _write_shards(self, folder: str, writers: Dict[int, str], step: int) -> bool:
        """Each shard of the state of ``step`` written to ``folder`` by its writer (shard -> worker);
        True once every one is written, False when one failed or died, or time ran out."""
        try:
            os.makedirs(folder, mode=PRIVATE_DIR_MODE, exist_ok=True)
        except OSError as e:
            self.save_error = f"cannot create {folder}: {write_failure(e, folder)}"
            log.error("%s", self.save_error)
            return False
        self.shard_saves = {}
        for shard, wid in sorted(writers.items()):
            name = "state.pt" if not self.layout.sharded else f"shard{shard}.pt"
            self.control.send(self.workers[wid], {"type": "save", "path": os.path.join(folder, name), "shard": shard, "step": step})
        dead = lambda: any(self.workers[w].role == "dead" for w in writers.values())  # noqa: E731
        await self._until(lambda: len(self.shard_saves) == len(writers) or dead() or self.save_error is not None, self.cfg.cluster.recovery_timeout_s)
        return len(self.shard_saves) == len(writers)

    async def _save_final(self, done: Dict[str, Any]) -> Dict[str, Any]:
        """train.save_final: the state every rank finished with, one file per shard (written by
        the lowest rank holding it), then its index and the full model (rank 0, from the files):
        RUN_DIR/final/state/ and RUN_DIR/final/model.pt. What was written, or why not."""
        step = self.cfg.train.steps
        folder = os.path.join(self.run_dir, "final")
        writers: Dict[int, str] = {}
        for w in sorted(done, key=lambda w: self.workers[w].rank):
            writers.setdefault(self.layout.shard_of.get(self.workers[w].rank, 0), w)
        if not await self._write_shards(os.path.join(folder, "state"), writers, step):
            return {"error": f"the final state was not written: {self.save_error or 'a writer did not answer'}"}
        files = [self.shard_saves[k]["path"] for k in sorted(self.shard_saves)]
        self.final = None
        self.control.send(self.workers[self.ranks[0]], {"type": "export", "files": files, "out": os.path.join(folder, "model.pt"), "step": step})
        await self._until(lambda: self.final is not None or self.workers[self.ranks[0]].role == "dead", self.cfg.cluster.recovery_timeout_s)
        return self.final or {"error": f"rank 0 did not write {os.path.join(folder, 'model.pt')} within cluster.recovery_timeout_s={self.cfg.cluster.recovery_timeout_s}s"}

    def _where_saved(self, saved: Optional[Dict[str, Any]]) -> str:
        """What the emergency copy holds, said plainly: written, a newer one kept, or nothing."""
        if saved and saved.get("written", True):
            return f"State of step {saved['step']} saved to {saved['path']}. "
        if saved:
            return f"A verified copy of step {saved['step']} was already at {saved['path']} and is kept (no survivor held a newer step). "
        previous = f" The copy of step {self.resume['step']} this job resumed from stays at {self.resume['path']}." if self.resume else ""
        return f"No state could be saved: {self.save_error or 'nothing trained survived'}.{previous} "

    async def _save_and_requeue(self, reason: str, survivors: Dict[int, str], held: Optional[Dict[str, Any]] = None, state_lost: bool = False) -> int:
        """The allocation cannot go on: save once; requeue where the launcher can, else stop.
        ``state_lost``: some shard is held by nobody (its owner and every holder failed): nothing
        newer than the last copy written can be saved, and the job never goes on without it."""
        if held is None:
            held = await self._hold_all(survivors)
        saved = None if state_lost else await self._save_state(survivors, held)
        resume_from = saved or self.copies.newest or self.resume
        if state_lost:
            last = f"the last copy written is the one of step {self.resume['step']} ({self.resume['path']})" if self.resume else "no copy was ever written"
            where = f"No newer state survives: {last}. "
        else:
            where = self._where_saved(saved)
        self._emit("emergency_save", reason=reason, saved=saved, error=None if saved else self.save_error)
        requeue_why = await self._off_loop(self.launcher.requeue, reason) if resume_from else "there is no copy to resume from"
        if requeue_why is None:
            log.warning("%s. %sJob requeued: the restarted job resumes from the copy of step %d with the failed nodes excluded", reason, where, resume_from["step"])
            return self._finish(EXIT_REQUEUED, "requeued", f"{reason}. {where}requeued")
        msg = f"cannot continue: {reason}. {where}Not requeued: {requeue_why}. "
        if state_lost:
            msg += "HINT: raise replication.factor (more copies of each shard, on other nodes), or use parallel=hsdp with more replicas"
        else:
            msg += "HINT: raise cluster.spare_nodes (or cluster.max_refills) so that a spare is left for every failure you expect"
        log.error(msg)
        return self._finish(EXIT_NO_SPARE, "state_lost" if state_lost else "no_spare", msg)

    async def _stop_nonfinite(self, nf: Dict[str, Any]) -> int:
        """train.on_nonfinite=stop: keep the last finite committed state (written once), say which
        step and rank saw what, and end the job."""
        survivors = self._quiesce_targets()
        saved = await self._save_state(survivors, await self._hold_all(survivors))
        what = f"loss {nf.get('loss')}" if str(nf.get("loss")) in ("nan", "inf", "-inf") else f"gradient norm {nf.get('grad_norm')}"
        if saved and saved.get("written", True):
            where = f"the last finite state, after {saved['step']} committed steps, is saved to {saved['path']}"
        else:
            where = self._where_saved(saved).rstrip(". ")
        t = self.cfg.train
        if nf.get("skipped") is None:
            why, hint = "train.on_nonfinite=stop", "set train.on_nonfinite=skip to drop such steps"
        else:
            why = (
                f"train.on_nonfinite=skip has dropped {nf['skipped']} of train.steps={t.steps} steps already, "
                f"the most train.max_skipped_fraction={t.max_skipped_fraction} allows"
            )
            hint = "raise train.max_skipped_fraction (1.0: no limit) only if dropping that many steps is what you want"
        msg = (
            f"step {nf.get('step')} (0-based): {what} is not finite (rank {nf.get('rank')} on node {nf.get('node')}, {why}); "
            f"{where}. HINT: lower optim.lr, set train.clip_grad_norm, or {hint}"
        )
        log.error(msg)
        self._emit("emergency_save", reason="non-finite step", saved=saved)
        return self._finish(EXIT_NONFINITE, "nonfinite", msg)

    async def _complete(self) -> int:
        done = self._g(self.gen).done
        sha, error = self.layout.final_sha(done, {w: self.workers[w].rank for w in done})
        if sha is None:
            return self._finish(EXIT_FAILED, "failed", error)
        self._emit("replicas_verified", step=self.cfg.train.steps, sha256=sha, ranks=len(done))
        if not self.cfg.train.save_final:
            return self._finish(EXIT_OK, "completed", None, final_sha=sha)
        final = await self._save_final(done)
        if "error" in final:
            msg = f"training completed (state sha256 {sha}), but {final['error']}. HINT: free space in {self.run_dir} (or run with hydra.run.dir on a writable filesystem with room); train.save_final=false skips it"
            log.error("%s", msg)
            return self._finish(EXIT_FAILED, "final_save_failed", msg, final_sha=sha, final=final)
        log.info("the trained model: %s (sha256 %s); the whole training state: %s", final["model"]["path"], final["model"]["sha256"][:12], final["state"]["path"])
        return self._finish(EXIT_OK, "completed", None, final_sha=sha, final=final)

    def _layout_summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"mode": self.layout.mode, "survives_node_losses": self.layout.survives()}
        if self.layout.sharded:
            done = self._g(self.gen).done
            out["copies_bytes_by_rank"] = {str(self.workers[w].rank): m.copies_bytes for w, m in sorted(done.items()) if m.copies_bytes is not None}
            out["copy_costs_by_rank"] = {str(self.workers[w].rank): m.copy_costs for w, m in sorted(done.items()) if m.copy_costs is not None}
        return out

    def _finish(self, code: int, status: str, error: Optional[str], final_sha: Optional[str] = None, final: Optional[Dict[str, Any]] = None) -> int:
        self.stopping = True
        self.progress.close()
        now = self.clock()
        t_train = self._t_train or now
        productive = self.steps.productive_s
        wall = now - t_train
        summary = {
            "job": self.job_id,
            "status": status,
            "exit_code": code,
            "error": error,
            "steps_completed": self.steps.last_step or 0,
            "steps_requested": self.cfg.train.steps,
            "final_state_sha256": final_sha,
            "final": final,  # train.save_final: the model file and the state folder, with their sha256
            "world_size": self.world,
            "generations": self.gen + 1,
            "startup_s": round(t_train - self._t_start, 3),
            "wall_s": round(wall, 3),
            "productive_s": round(productive, 3),
            "goodput": round(goodput(productive, wall), 4),
            "final_loss": self.steps.last_loss,
            "final_metrics": self.last_metrics,  # the task's own, of the last step
            "eval": self.last_eval,  # the last evaluation: {"step", "metrics"}
            "faults": fault_list(self.cfg.fault),
            "faults_fired": sorted(self.faults_done),
            "excluded_nodes": sorted(self.bad_nodes),
            "recoveries": [r.report() for r in self.recoveries],
            "heartbeat_delay": self.hb_delay.report(),  # the workers' clocks against ours: exact on one machine only
            "coordinator_stalls": {"total_s": round(self.stalls.stalled_s, 3), "worst_s": round(self.stalls.worst_s, 3)},
            "skipped_steps": dict(self.skipped),
            "saved_state": self.saved,
            "parallel": self._layout_summary(),
            "resumed_from": self.resume,
            "run_dir": self.run_dir,
            "record_errors": self.write_failures.messages,  # files of the run record that could not be written (record.py)
        }
        self.summary = summary
        try:
            write_json(os.path.join(self.run_dir, "summary.json"), summary)
        except RecordError as e:  # the job's own exit code stands: the result goes to the console (run.human_summary)
            self.write_failures.report(e.path, str(e))
            summary["record_errors"] = self.write_failures.messages
        self._emit("job_finished", status=status, exit_code=code, error=error)
        return code
