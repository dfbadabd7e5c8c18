"""Durable copies on a schedule (``train.save_every=N`` steps; ``train.save_every_s=S``: the
coordinator names a step a little ahead every S seconds, ``copy_at``): after such a step, the
writer of each piece (rank 0 for the replicated state; every rank its own shard for ``zero`` and
``fsdp``; the first shard group for ``hsdp``) takes a copy of its state in memory and writes it in
a thread of its own to ``RUN_DIR/saved/step<step>/`` (state/emergency.py's atomic write), while
training goes on. The coordinator indexes a copy once every piece of it is written and keeps the
newest ``train.keep_saved``; then the process that wrote its shard 0 writes it as a DCP checkpoint,
``saved/step<step>/dcp`` (worker/dcp_copies.py), in the background too."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..control.messages import Encodable, PeriodicFailed, PeriodicSaved
from ..rundir.paths import RunPaths, state_file
from ..state import emergency, export
from ..config import group_size
from ..state.placement import REPLICA_GROUPS
from .dcp_copies import WRITER, needs_model

log = logging.getLogger("ckptless_hpc.worker")


def writes(mode: str, rank: int, shard_size: Optional[int]) -> bool:
    """Whether ``rank`` writes its piece: the lowest rank holding each shard does."""
    if mode in ("zero", "fsdp"):
        return True
    return rank < (int(shard_size or 1) if mode in REPLICA_GROUPS else 1)


class PeriodicCopies:
    def __init__(self, cfg: Any, run_dir: Optional[str], send: Callable[[Encodable], None], build_model: Optional[Callable[[], Any]] = None) -> None:
        self.every, self.last = int(cfg.train.save_every), int(cfg.train.steps)
        self.mode, self.shard_size = str(cfg.parallel.mode), group_size(cfg.parallel)
        self.run_dir, self.send = run_dir, send
        cluster = getattr(cfg, "cluster", None)  # the copy's index comes within a round trip of its last piece
        self.index_wait_s = float(getattr(cluster, "recovery_timeout_s", 60.0))
        self.build_model = build_model  # the engine's: a fresh model presents keys a state_dict hook makes
        self._presenter: Optional[Any] = None  # that model, built once on the training thread
        self._writing: Optional[threading.Thread] = None
        self._asked: Set[int] = set()  # steps the coordinator asked for (train.save_every_s)

    def ask(self, step: int) -> None:
        """A copy of ``step`` (from the reader thread: the coordinator's ``copy_at``)."""
        self._asked.add(step)

    def due(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or step in self._asked

    def after_commit(self, step: int, rank: int, shards: List[int], collect: Callable[..., Any]) -> None:
        """``step`` is committed: copy it and start writing it if it is due here (the last step
        is the final state's: train.save_final). ``shards``: the pieces this process writes (its
        own; in a job that shrank under ZeRO the lost ranks' it steps too)."""
        if self.run_dir is None or not self.due(step) or step >= self.last or not writes(self.mode, rank, self.shard_size):
            return
        self._asked = {s for s in self._asked if s > step}
        if self._writing is not None and self._writing.is_alive():
            log.warning("the copy before step %d is still being written: step %d is not copied (raise train.save_every)", step, step)
            return
        folder = RunPaths(self.run_dir).saved_step(step)
        pieces = []
        for shard in shards:
            entries, meta = collect(step) if self.mode == "ddp" else collect(step, shard=shard)
            entries = [(n, t.detach().clone()) for n, t in entries]  # training goes on over the live tensors
            pieces.append((os.path.join(folder, state_file(None if self.mode == "ddp" else shard)), entries, meta, shard))
        self._writing = threading.Thread(target=self._write, args=(pieces, step), name=f"copy-step{step}", daemon=True)
        self._writing.start()
        if 0 in shards:  # the writer of shard 0 writes the copy's DCP checkpoint once it is complete
            WRITER.after_index(folder, step, self.index_wait_s, self._present_with(pieces[0][2]), what="periodic copy", prunable=True)

    def _present_with(self, meta: Dict[str, Any]) -> Optional[Callable[[], Any]]:
        if not needs_model(meta) or self.build_model is None:
            return None
        if self._presenter is None:
            self._presenter = self.build_model()  # here, on the training thread: building forks and restores its RNG
        return lambda: self._presenter

    def _write(self, pieces: List[Tuple[str, Any, Dict[str, Any], int]], step: int) -> None:
        for path, entries, meta, shard in pieces:
            try:
                rec = emergency.write(path, entries, meta, describe=f"periodic copy, shard {shard}: ")
            except emergency.EmergencyCopyError as e:
                log.error("%s", e)
                self.send(PeriodicFailed(path, str(e), step))
                return
            self.send(PeriodicSaved(path, step, shard, rec["sha256"], export.file_sha256(path), rec["bytes"]))
