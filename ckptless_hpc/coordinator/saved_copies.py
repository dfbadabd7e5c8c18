"""The copies of ``train.save_every`` (written by the workers: worker/periodic.py): a copy is
complete once every piece of its step is written; then its ``index.json`` is written (what
``resume_from`` and ``ckptless-hpc export`` read) and only the newest ``train.keep_saved``
complete copies are kept. The record of the newest is what a requeued job may start from."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Any, Dict, List, Optional

from ..rundir.paths import INDEX, RunPaths, step_folder, step_of_folder
from ..rundir.record import RecordError, write_json

log = logging.getLogger("ckptless_hpc.coordinator")


class SavedCopies:
    def __init__(self, run_dir: str, shards: int, keep: int, mode: str) -> None:
        self.root, self.shards, self.keep, self.mode = RunPaths(run_dir).saved, shards, keep, mode
        self.pieces: Dict[int, Dict[int, Any]] = {}  # step -> shard -> its record
        self.newest: Optional[Dict[str, Any]] = None
        self.last_asked: Optional[float] = None  # when train.save_every_s last named a step

    def timed(self, now: float, step: int, every_s: float, ahead: int = 2) -> Optional[int]:
        """train.save_every_s: the step to copy (a little ahead of rank 0's ``step``, so that every
        writer hears of it before it gets there) when ``every_s`` has passed since the last; else None."""
        if every_s <= 0:
            return None
        if self.last_asked is None:
            self.last_asked = now
        if now - self.last_asked < every_s:
            return None
        self.last_asked = now
        return step + ahead

    def add(self, m: Any) -> Optional[Dict[str, Any]]:
        """One piece written; the copy's record (as restart.json keeps it) once it is complete."""
        got = self.pieces.setdefault(m.step, {})
        got[m.shard] = m
        if len(got) < self.shards:
            return None
        del self.pieces[m.step]
        folder = os.path.dirname(got[0].path)
        files = {str(k): {"file": os.path.basename(p.path), "sha256": p.sha256, "bytes": p.bytes, "state_sha256": p.state_sha256} for k, p in sorted(got.items())}
        index = {"format": 1, "mode": self.mode, "step": m.step, "files": files}
        try:
            write_json(os.path.join(folder, INDEX), index)
        except RecordError as e:
            log.error("the copy of step %d is written but not its index, so it is not used: %s", m.step, e)
            return None
        if self.shards == 1:
            rec = {"path": got[0].path, "step": m.step, "sha256": got[0].state_sha256}
        else:
            rec = {"path": folder, "step": m.step, "sha256": None, "shards": {str(k): {"path": p.path, "sha256": p.state_sha256} for k, p in sorted(got.items())}}
        if self.newest is None or rec["step"] > self.newest["step"]:
            self.newest = rec
        self._prune(m.step)  # a few unlinks: a copy is a file per shard
        return rec

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` complete copies; delete the others, and every incomplete one
        older than ``newest`` (each writer writes its copies in order: a piece of it still to
        come would have come first)."""
        root = self.root
        complete = [s for s in _steps(root) if os.path.isfile(os.path.join(root, step_folder(s), INDEX))]
        kept = set(complete[-self.keep :])
        for s in _steps(root):
            if s < newest and s not in kept:
                drop(os.path.join(root, step_folder(s)))


def drop(folder: str) -> None:
    """Delete a copy: its index first (a copy without one is not a copy: resume_from, export
    and the DCP writer of worker/dcp_copies.py, which removes what it wrote into a copy dropped
    meanwhile, read it so), then the folder."""
    with contextlib.suppress(OSError):
        os.remove(os.path.join(folder, INDEX))
    shutil.rmtree(folder, ignore_errors=True)


def _steps(root: str) -> List[int]:
    try:
        return sorted(s for n in os.listdir(root) if (s := step_of_folder(n)) is not None)
    except OSError:
        return []
