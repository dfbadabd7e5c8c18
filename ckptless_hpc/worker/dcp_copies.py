"""The DCP checkpoints (state/dcp.py) of the saved copies a worker writes, in the background so
that no step waits for them:

- a periodic copy (worker/periodic.py) and a sharded emergency copy (worker/storage.py): the
  process that writes the copy's shard 0 waits for the copy's ``index.json`` (the coordinator
  writes it once every piece is written), then reads the copy's files, each checked against the
  index, and writes ``dcp/`` beside them (state/export.py ``copy_to_dcp``);
- the replicated emergency copy: its writer, from the state it just wrote (worker/storage.py).

One thread per process writes them, one after the other, each wait bounded;
:meth:`DcpWriter.finish` (the worker's stop) ends the waits for copies that will not complete
and lets what is written end within its bound. A DCP checkpoint that cannot be written is said
in the log and never fails the copy: the copy itself is what recovery and ``resume_from`` read,
and ``ckptless-hpc export COPY --format dcp`` writes it later. A model whose ``state_dict`` hooks
make keys of their own is presented by a fresh model built by the caller, on its own thread
(building a model draws from the RNG training uses)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Optional

import torch

from ..rundir.paths import INDEX
from ..state import export

log = logging.getLogger("ckptless_hpc.worker")

POLL_S = 0.05
FINISH_S = 60.0  # at a stop, for the DCP checkpoints still being written (the launcher's exit_timeout_s ends a longer wait)


def needs_model(meta: Dict[str, Any]) -> bool:
    """Whether presenting this state's user view needs the model itself (keys a hook makes)."""
    return bool((meta.get("user_view") or {}).get("renamed"))


class DcpWriter:
    def __init__(self) -> None:
        self._jobs: Deque[Callable[[], None]] = deque()
        self._cv = threading.Condition()
        self._running = False  # a thread takes jobs (set and cleared under the lock: a job is never left behind)
        self.closing = threading.Event()  # the worker stops: no copy not yet complete will be

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._jobs.append(job)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="dcp-copies", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._jobs:
                    self._running = False
                    self._cv.notify_all()
                    return
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # noqa: BLE001 - a user's DCP copy: said, never the job's failure
                log.exception("a DCP checkpoint could not be written")

    def finish(self, timeout_s: float = FINISH_S) -> bool:
        """Stop waiting for copies that are not complete; wait up to ``timeout_s`` for what is
        queued to be written. True when nothing is left."""
        self.closing.set()
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.5))
            done = not self._running
        if not done:
            log.warning("a DCP checkpoint was still being written after %.0fs: left unfinished", timeout_s)
        return done

    def after_index(
        self, folder: str, step: int, timeout_s: float, build_model: Optional[Callable[[], torch.nn.Module]] = None, what: str = "copy", prunable: bool = False
    ) -> None:
        """Once ``folder/index.json`` names the copy of ``step`` complete (within ``timeout_s``),
        its DCP checkpoint: ``folder/dcp``. ``prunable``: a periodic copy, whose folder the
        coordinator deletes (index first, coordinator/saved_copies.py ``drop``) once newer copies
        are kept; one deleted while its checkpoint is written is deleted again after it (the write
        would bring the folder back)."""

        def job() -> None:
            index = self._wait_index(folder, step, timeout_s)
            if index is None:
                return
            t0 = time.monotonic()
            recs = [rec for _, rec in sorted(index["files"].items(), key=lambda kv: int(kv[0]))]
            try:
                rec = export.copy_to_dcp([os.path.join(folder, r["file"]) for r in recs], None, [r.get("state_sha256") for r in recs], build_model)
            except export.ExportError as e:
                rec = None
                log.warning("the %s of step %d has no DCP checkpoint: %s", what, step, e)
            finally:  # a periodic copy pruned while written (train.keep_saved, index first): what the write made goes too
                dropped = prunable and not os.path.exists(os.path.join(folder, INDEX))
                if dropped:
                    shutil.rmtree(folder, ignore_errors=True)
            if dropped:
                log.info("the %s of step %d was pruned while its DCP checkpoint was written: removed", what, step)
            elif rec is not None:
                log.info("the %s of step %d as a DCP checkpoint: %s (%.1f MB, %.2fs)", what, step, rec["path"], rec["bytes"] / 1e6, time.monotonic() - t0)

        self.submit(job)

    def _wait_index(self, folder: str, step: int, timeout_s: float) -> Optional[Dict[str, Any]]:
        """The copy's index once written; None when the stop came, ``timeout_s`` passed or the
        coordinator pruned the folder (an incomplete copy older than a complete one) first."""
        deadline, seen = time.monotonic() + timeout_s, False
        while True:
            index = _index(folder, step)
            if index is not None:
                return index
            there = os.path.isdir(folder)
            seen = seen or there
            if self.closing.is_set() or time.monotonic() > deadline or (seen and not there):
                index = _index(folder, step)  # a last look: it may have come with the stop
                if index is None:
                    log.info("the copy of step %d in %s was not completed (no %s): no DCP checkpoint of it", step, folder, INDEX)
                return index
            self.closing.wait(POLL_S)


def _index(folder: str, step: int) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(folder, INDEX), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    return index if int(index.get("step", -1)) == step else None


WRITER = DcpWriter()  # the process's one writer (a worker is one process)
