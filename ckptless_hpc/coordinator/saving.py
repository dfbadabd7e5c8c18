"""How a job ends, carried out: completed (replicas verified, the final state saved), or stopped
with its state saved once (no spare left, preemption, a non-finite step), then requeued where
the launcher can. What is said and which rank writes what are verdicts.py's; the files and
their bookkeeping are the run record's (record.py); this class sends, waits and counts."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, Dict, Optional

from ..control.messages import Abort, Export, Save, Stop
from ..rundir.paths import INDEX, state_file
from ..rundir.record import PRIVATE_DIR_MODE, RecordError, write_failure, write_json
from ..state.placement import plan_shards
from . import verdicts
from .sharding import inventories
from .tally import Arrivals
from .verdicts import EXIT_FAILED, EXIT_NONFINITE, EXIT_OK, EXIT_REQUEUED

log = logging.getLogger("ckptless_hpc.coordinator")


class Saver:
    """``wait(cond, timeout_s)``: the shell's wake-up; ``finish(code, status, error, **summary)``:
    the shell's end of the job; ``off_loop(fn, *args)``: a launcher call off the event loop."""

    def __init__(
        self,
        cfg: Any,
        record: Any,
        job: Any,
        layout: Any,
        control: Any,
        launcher: Any,
        wait: Callable[..., Any],
        emit: Callable[..., Any],
        persist: Callable[[], None],
        off_loop: Callable[..., Any],
        finish: Callable[..., int],
    ) -> None:
        self.cfg, self.record, self.job, self.layout, self.control, self.launcher = cfg, record, job, layout, control, launcher
        self.wait, self.emit, self.persist, self.off_loop, self.finish = wait, emit, persist, off_loop, finish

    @property
    def workers(self) -> Dict[str, Any]:
        return self.job.members.workers

    @property
    def timeout_s(self) -> float:
        return self.cfg.cluster.recovery_timeout_s

    async def hold_all(self, survivors: Dict[int, str]) -> Dict[str, Any]:
        """Abort the in-flight step everywhere (a new generation) and collect the committed steps."""
        gen = self.job.next_generation()
        g = self.job.g(gen)
        self.control.broadcast(survivors.values(), Abort(gen).encode())
        await self.wait(Arrivals(survivors.values(), g.held.__contains__), self.timeout_s)
        return {w: m.step for w, m in g.held.items()}

    async def save_state(self, survivors: Dict[int, str], held: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Have one rank holding the newest committed step write it to the run directory, once.

        Only a worker holding the job's state reports a step (a spare that never received it
        reports none): a freshly built model is never saved as the job's state."""
        r = self.record
        if self.layout.sharded:
            return await self._save_shards()
        chosen = verdicts.save_holder(survivors, held)
        if chosen is None:
            r.save_error = "nothing trained survived (no surviving worker holds the job's state; a spare that never received it holds a fresh model, which is not saved)"
            return None
        target, holder = chosen
        path = r.paths.emergency
        self.control.send(self.workers[holder], Stop(save=path).encode())
        written = await self.wait(lambda: r.saved is not None or r.save_error is not None or self.workers[holder].role == "dead", self.timeout_s)
        if r.saved:
            self.persist()
        elif r.save_error is None:
            why = "it died while writing" if written else f"it did not answer within cluster.recovery_timeout_s={self.timeout_s}s"
            r.save_error = f"rank {self.workers[holder].rank} ({holder}) was asked to write the state of step {target} to {path}, but {why}"
        return r.saved

    async def _save_shards(self) -> Optional[Dict[str, Any]]:
        """A sharded emergency copy: every shard, at the newest step at which every shard is held,
        written once by one worker holding it (its owner, a holder of a copy, a replica). None
        when some shard is held by nobody: a partial copy is never written nor reported."""
        r = self.record
        plan, why = plan_shards({}, self.layout.shard_of, inventories(self.job.g(self.job.gen).held))
        if plan is None:
            log.error("no emergency copy can be written: %s", why)
            return None
        folder = r.paths.emergency_folder(plan.target_step)
        writers = {shard: workers[shard % len(workers)] for shard, workers in sorted(plan.holders_at_target.items())}
        if not await self.write_shards(folder, writers, plan.target_step):
            log.error("the sharded emergency copy is incomplete (%d of %d shards written): not used", len(r.shard_saves), len(writers))
            r.save_error = r.save_error or f"the sharded copy is incomplete ({len(r.shard_saves)} of {len(writers)} shards written)"
            return None
        h = hashlib.sha256()
        for shard in sorted(r.shard_saves):
            h.update(f"{shard}:{r.shard_saves[shard]['sha256']};".encode())
        shards = {str(k): {"path": v["path"], "sha256": v["sha256"]} for k, v in sorted(r.shard_saves.items())}
        r.saved = {"path": folder, "step": plan.target_step, "sha256": h.hexdigest(), "shards": shards}
        self.persist()
        self._index(folder, plan.target_step)
        return r.saved

    def _index(self, folder: str, step: int) -> None:
        """A complete sharded emergency copy's index.json, as a periodic copy's (what ``export`` and
        ``resume_from`` check its files against; the writer of its shard 0 then writes its DCP
        checkpoint: worker/storage.py)."""
        files = {str(k): {"file": os.path.basename(v["path"]), "state_sha256": v["sha256"]} for k, v in sorted(self.record.shard_saves.items())}
        try:
            write_json(os.path.join(folder, INDEX), {"format": 1, "mode": self.layout.mode, "step": step, "files": files})
        except RecordError as e:
            log.warning("the emergency copy of step %d is written but not its index (nor its DCP checkpoint): %s", step, e)

    async def write_shards(self, folder: str, writers: Dict[int, str], step: int) -> bool:
        """Each shard of the state of ``step`` written to ``folder`` by its writer (shard -> worker);
        True once every one is written, False when one failed or died, or time ran out."""
        r = self.record
        try:
            os.makedirs(folder, mode=PRIVATE_DIR_MODE, exist_ok=True)
        except OSError as e:
            r.save_error = f"cannot create {folder}: {write_failure(e, folder)}"
            log.error("%s", r.save_error)
            return False
        r.shard_saves = {}
        for shard, wid in sorted(writers.items()):
            name = state_file(shard if self.layout.sharded else None)
            self.control.send(self.workers[wid], Save(os.path.join(folder, name), shard, step).encode())
        dead = lambda: any(self.workers[w].role == "dead" for w in writers.values())  # noqa: E731
        await self.wait(lambda: len(r.shard_saves) == len(writers) or dead() or r.save_error is not None, self.timeout_s)
        return len(r.shard_saves) == len(writers)

    async def save_final(self, done: Dict[str, Any]) -> Dict[str, Any]:
        """train.save_final: the state every rank finished with, one file per shard (written by
        the lowest rank holding it), then its index and the full model (the lowest live rank, from the files):
        RUN_DIR/final/state/ and RUN_DIR/final/model.pt. What was written, or why not."""
        r, step = self.record, self.cfg.train.steps
        adopted = {w: [int(k) for k in m.adopted] for w, m in done.items() if m.adopted}
        writers = verdicts.final_writers(done, {w: self.workers[w].rank for w in done}, self.layout.shard_of, adopted)
        if not await self.write_shards(r.paths.final_state, writers, step):
            return {"error": f"the final state was not written: {r.save_error or 'a writer did not answer'}"}
        files = [r.shard_saves[k]["path"] for k in sorted(r.shard_saves)]
        r.final = None
        lowest = min(self.job.members.ranks)  # rank 0, unless a job that shrank lost it
        exporter = self.workers[self.job.members.ranks[lowest]]
        self.control.send(exporter, Export(files, r.paths.final_model, step).encode())
        await self.wait(lambda: r.final is not None or exporter.role == "dead", self.timeout_s)
        return r.final or {"error": f"rank {lowest} did not write {r.paths.final_model} within cluster.recovery_timeout_s={self.timeout_s}s"}

    # ---------------------------------------------------------------- the endings
    async def save_and_requeue(self, reason: str, survivors: Dict[int, str], held: Optional[Dict[str, Any]] = None, state_lost: bool = False) -> int:
        """The allocation cannot go on: save once; requeue where the launcher can, else stop.
        ``state_lost``: some shard is held by nobody (its owner and every holder failed): nothing
        newer than the last copy written can be saved, and the job never goes on without it."""
        r = self.record
        if held is None:
            held = await self.hold_all(survivors)
        saved = None if state_lost else await self.save_state(survivors, held)
        resume_from = saved or r.copies.newest or r.resume
        where = verdicts.state_lost_where(r.resume) if state_lost else verdicts.where_saved(saved, r.resume, r.save_error)
        self.emit("emergency_save", reason=reason, saved=saved, error=None if saved else r.save_error)
        requeue_why = await self.off_loop(self.launcher.requeue, reason) if resume_from else "there is no copy to resume from"
        if requeue_why is None:
            log.warning("%s. %sJob requeued: the restarted job resumes from the copy of step %d with the failed nodes excluded", reason, where, resume_from["step"])
            return self.finish(EXIT_REQUEUED, "requeued", f"{reason}. {where}requeued")
        status, msg = verdicts.not_requeued(reason, where, requeue_why, state_lost)
        log.error(msg)
        return self.finish(verdicts.EXIT_NO_SPARE, status, msg)

    async def stop_nonfinite(self, nf: Dict[str, Any]) -> int:
        """train.on_nonfinite=stop: keep the last finite committed state (written once), say which
        step and rank saw what, and end the job."""
        survivors = self.job.members.survivors()
        saved = await self.save_state(survivors, await self.hold_all(survivors))
        msg = verdicts.nonfinite(nf, saved, verdicts.where_saved(saved, self.record.resume, self.record.save_error), self.cfg.train)
        log.error(msg)
        self.emit("emergency_save", reason="non-finite step", saved=saved)
        return self.finish(EXIT_NONFINITE, "nonfinite", msg)

    async def complete(self) -> int:
        done = self.job.g(self.job.gen).done
        sha, error = self.layout.final_sha(done, {w: self.workers[w].rank for w in done})
        if sha is None:
            return self.finish(EXIT_FAILED, "failed", error)
        self.emit("replicas_verified", step=self.cfg.train.steps, sha256=sha, ranks=len(done))
        if not self.cfg.train.save_final:
            return self.finish(EXIT_OK, "completed", None, final_sha=sha)
        final = await self.save_final(done)
        if "error" in final:
            msg = verdicts.final_save_failed(sha, final["error"], self.record.run_dir)
            log.error("%s", msg)
            return self.finish(EXIT_FAILED, "final_save_failed", msg, final_sha=sha, final=final)
        log.info("the trained model: %s (sha256 %s); the whole training state: %s", final["model"]["path"], final["model"]["sha256"][:12], final["state"]["path"])
        return self.finish(EXIT_OK, "completed", None, final_sha=sha, final=final)
