"""The copies of ``train.save_every`` (written by the workers: worker/periodic.py): a copy is
complete once every piece of its step is written; then its ``index.json`` is written (what
``resume_from`` and ``ckptless-hpc export`` read) and only the newest ``train.keep_saved``
complete copies are kept. The record of the newest is what a requeued job may start from."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any, Dict, List, Optional

log = logging.getLogger("ckptless_hpc.coordinator")
_STEP = re.compile(r"^step(\d+)$")


class SavedCopies:
    def __init__(self, run_dir: str, shards: int, keep: int, mode: str) -> None:
        self.root, self.shards, self.keep, self.mode = os.path.join(run_dir, "saved"), shards, keep, mode
        self.pieces: Dict[int, Dict[int, Any]] = {}  # step -> shard -> its record
        self.newest: Optional[Dict[str, Any]] = None

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
        tmp = os.path.join(folder, "index.json.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
            os.replace(tmp, os.path.join(folder, "index.json"))
        except OSError as e:
            log.error("the copy of step %d is written but its index is not (%s in %s): it is not used. HINT: free space there", m.step, e.strerror, folder)
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
        """Delete complete copies beyond the newest ``keep`` and anything older than those."""
        complete = sorted((s for s in _steps(self.root) if s <= newest and os.path.isfile(os.path.join(self.root, f"step{s}", "index.json"))), reverse=True)
        if len(complete) < self.keep:
            return
        oldest_kept = complete[self.keep - 1]
        for s in _steps(self.root):
            if s < oldest_kept:
                shutil.rmtree(os.path.join(self.root, f"step{s}"), ignore_errors=True)


def _steps(root: str) -> List[int]:
    try:
        return sorted(int(m.group(1)) for n in os.listdir(root) if (m := _STEP.match(n)))
    except OSError:
        return []

