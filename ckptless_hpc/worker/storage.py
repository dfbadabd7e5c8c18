"""The worker's side of the job's one storage copy: the emergency copy written when the whole
allocation must go (state/emergency.py: never over a newer copy, never a damaged one), one shard
of it in a sharded mode, and the copy a requeued job starts from. Each emergency copy is also
written as a DCP checkpoint beside it (state/dcp.py: ``state/dcp``, ``state/emergency-step<S>/dcp``),
after the copy itself: the replicated one by its writer from the state in memory, a sharded one
by the writer of shard 0 once the coordinator has indexed it (worker/dcp_copies.py)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..rundir import paths
from ..state import dcp, emergency, export
from ..control.client import exit_now
from ..control.messages import Exported, ExportFailed, LoadFailed, Saved, SaveFailed
from .dcp_copies import WRITER, needs_model
from .interrupt import Aborted
from .seams import EngineState, Sender
from .shard_copies import ShardCopies
from .standing import Standing

log = logging.getLogger("ckptless_hpc.worker")

INDEX_WAIT_S = 60.0  # a sharded emergency copy's index comes within a round trip of its last shard


def copy_kind(path: str) -> str:
    """What the state file at ``path`` is, told by where it lies (rundir/paths.py), for the log
    line of a load: a periodic copy (saved/step<S>/), the final state (final/state/), the
    emergency copy (the run's state/), else a saved copy (one a user moved elsewhere)."""
    folder = os.path.dirname(os.path.abspath(path))
    parent, name = os.path.split(folder)
    if os.path.basename(parent) == paths.SAVED and paths.step_of_folder(name) is not None:
        return "a periodic copy"
    if os.path.basename(parent) == paths.FINAL and name == paths.STATE:
        return "the final state"
    if paths.STATE in (name, os.path.basename(parent)):
        return "the emergency copy"
    return "a saved copy"


class StorageCopy:
    """What it reads of the worker is passed in: the engine, the control client, the shard
    copies (None in the replicated mode), its standing and ``held_step`` (peer_state.py);
    ``name`` is NODE.LOCAL, as its errors name the worker."""

    def __init__(self, engine: EngineState, client: Sender, shards: Optional[ShardCopies], standing: Standing, held_step: Callable[[], Optional[int]], name: str) -> None:
        self.engine, self.client, self.shards, self.standing = engine, client, shards, standing
        self.held_step, self.name = held_step, name

    def load(self, saved: Dict[str, Any], adopted: Optional[int] = None) -> None:
        """Start from the emergency copy of a requeued job (the one time state comes from storage);
        a missing or damaged copy is refused and ends the job (never loaded, never trained on).
        ``adopted``: a lost rank's shard this process steps (ZeRO, a job that starts shrunk)."""
        t0 = time.monotonic()
        try:
            entries, meta = emergency.read(saved["path"], saved.get("sha256"))
        except emergency.EmergencyCopyError as e:
            log.error("cannot resume: %s", e)
            self.client.send(LoadFailed(saved["path"], str(e)))
            raise Aborted("load") from None
        self.engine.apply(entries, meta, shard=adopted)
        self.standing.step = int(meta["step"])  # the log lines' step follows at the generation's first commit
        log.info("loaded %s of step %d from %s in %.2fs", copy_kind(saved["path"]), self.standing.step, saved["path"], time.monotonic() - t0)

    def save(self, path: str) -> Dict[str, Any]:
        """Write the committed state once (state/emergency.py: never over a newer copy, never a
        damaged one), then its DCP checkpoint; raises emergency.EmergencyCopyError when the copy
        cannot be written."""
        rec, entries, meta = self._write(path)
        self._dcp_beside(rec, entries, meta)
        return rec

    def _write(self, path: str) -> Tuple[Dict[str, Any], Any, Dict[str, Any]]:
        entries, meta = self.engine.collect(self.standing.step)
        return emergency.write(path, entries, meta), entries, meta

    def _dcp_beside(self, rec: Dict[str, Any], entries: Any, meta: Dict[str, Any]) -> None:
        """The replicated emergency copy just written (``rec``) as a DCP checkpoint beside it,
        from the same state in memory; a DCP that cannot be written is said, never the copy's failure."""
        if not rec.get("written", True):  # a newer copy was kept: its DCP stays as it is
            return
        out = paths.copy_dcp(os.path.dirname(rec["path"]))
        shutil.rmtree(out, ignore_errors=True)  # never an older state's DCP beside the new copy
        t0 = time.monotonic()
        try:
            user = export.full_model([(entries, meta)], build_model=self.engine.build_model)
            d = dcp.write(out, [(entries, meta)], user, dcp.source_of(out, rec["step"], [rec["path"]], [rec["sha256"]]))
        except Exception as e:  # noqa: BLE001 - the task's hooks, the filesystem: said, the copy stands
            log.warning("the emergency copy of step %d has no DCP checkpoint: %s: %s", rec["step"], type(e).__name__, e)
            return
        log.info("the emergency copy of step %d as a DCP checkpoint: %s (%.1f MB, %.2fs)", rec["step"], out, d["bytes"] / 1e6, time.monotonic() - t0)

    def save_shard(self, path: str, shard: int, step: int) -> None:
        """One shard of a sharded copy (an emergency copy, the final state; the replicated
        state is its shard 0): from a snapshot, a held copy, or the live state."""
        copy = self.shards.get(shard, step) if self.shards is not None else None
        live = self.shards.live_shards() if self.shards is not None else [0]
        if copy is None and shard in live and step == self.held_step():
            copy = self.engine.collect(step, shard=shard if self.shards is not None else None)
        if copy is None:
            held = self.shards.describe(self.standing.step) if self.shards is not None else f"it holds step {self.held_step()}"
            log.error("asked to save shard %d at step %d, which this worker does not hold (%s)", shard, step, held)
            self.client.send(SaveFailed(path, f"{self.name} does not hold shard {shard} at step {step}", step))
            return
        entries, meta = copy
        try:
            rec = emergency.write(path, entries, meta, describe=f"shard {shard}: ")
        except emergency.EmergencyCopyError as e:
            log.error("%s", e)
            self.client.send(SaveFailed(path, str(e), step))
            return
        self.client.send(Saved(path, rec["step"], rec["sha256"], shard=shard, bytes=rec["bytes"], written=rec["written"]))
        if shard == 0 and copy_kind(path) == "the emergency copy":  # its DCP checkpoint, once the coordinator indexes the copy
            present = self.engine.build_model() if needs_model(meta) else None  # here, not on the writer's thread: building forks the RNG
            WRITER.after_index(os.path.dirname(path), step, INDEX_WAIT_S, (lambda: present) if present is not None else None, what="emergency copy")

    def export(self, files: List[str], out: str, step: int) -> None:
        """The final state's index and full model (state/export.py), from its written files."""
        try:
            rec = export.write_final(os.path.dirname(files[0]), files, out, step, self.engine.mode, self.engine.user_view, self.engine.build_model)
        except export.ExportError as e:
            log.error("%s", e)
            self.client.send(ExportFailed(out, str(e)))
            return
        except Exception as e:  # the task's own code (build_model, a state_dict hook): named, never a silent hang
            log.exception("the final model could not be presented")
            self.client.send(ExportFailed(out, f"presenting the model's state_dict() for {out} failed in the task's own code: {type(e).__name__}: {e}"))
            return
        log.info("the trained model (step %d) is in %s (%.1f MB, sha256 %s)", step, out, rec["model"]["bytes"] / 1e6, rec["model"]["sha256"][:12])
        self.client.send(Exported(step, **rec))

    def stop(self, path: Optional[str]) -> None:
        """The coordinator's ``stop``: write the copy it asks for, if this process holds the job's state; then exit."""
        if path and self.held_step() is not None:
            try:
                rec, entries, meta = self._write(path)
            except emergency.EmergencyCopyError as e:
                log.error("%s", e)
                self.client.send(SaveFailed(path, str(e), self.standing.step))
            else:
                self.client.send(Saved(**rec))  # the coordinator waits for the copy, not for its DCP checkpoint:
                WRITER.submit(lambda: self._dcp_beside(rec, entries, meta))  # written after, before this process exits
        WRITER.finish()
        time.sleep(0.05)
        exit_now(0)
