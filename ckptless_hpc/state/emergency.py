"""The emergency copy: the one time training state touches storage (no spare left, preemption,
a non-finite step, a headless Slurm job), and the one time it is read back (a requeued job).

One file per call, free of any worker state, so that a sharded model writes one per shard:

- ``write(path, entries, meta)`` writes to a temporary file next to ``path``, fsyncs it, reads
  it back and checks it, and only then renames it over ``path``: a full disk, a read-only
  directory or a crash mid-write never damages the copy already there. A copy never replaces a
  newer one: when ``path`` holds a verified copy of a later step than ``meta["step"]``, that copy
  is kept and its record returned (``written: False``).
- ``read(path, sha256)`` refuses a missing, truncated or altered copy (its own embedded
  checksum, and the ``sha256`` recorded when it was written) with an error naming the path.

The file is an ordinary torch file ``{"meta": ..., "entries": {name: tensor}, "sha256": ...}``
(``torch.load(path, weights_only=True)``); ``sha256`` is ``state_sha256(entries, meta)``.
Files are read memory-mapped: checking a copy costs page cache, not a second copy in RAM.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Dict, Optional, Tuple

import torch

from ..rundir.record import PRIVATE_DIR_MODE, STATE_FILE_MODE, fsync_dir, remove_quietly, write_failure
from .snapshot import Entries, state_sha256

log = logging.getLogger("ckptless_hpc.state")

FORMAT = 1


class EmergencyCopyError(Exception):
    """The copy could not be written, or a copy read back is missing or damaged; the message
    names the path, what was wrong and what to do."""


def record_of(path: str, meta: Dict[str, Any], sha256: str, written: bool) -> Dict[str, Any]:
    return {"path": path, "step": int(meta["step"]), "sha256": sha256, "bytes": os.path.getsize(path), "written": written}


def write(path: str, entries: Entries, meta: Dict[str, Any], describe: str = "") -> Dict[str, Any]:
    """Write the state once, safely; returns its record ``{path, step, sha256, bytes, written}``.

    ``describe`` says who writes (for the log line: job, generation, rank, node). Raises
    ``EmergencyCopyError`` (the previous copy, if any, untouched) when the copy cannot be written.
    """
    step = int(meta["step"])
    sha = state_sha256(entries, meta)
    previous = step_of(path)
    kept = existing(path) if previous is not None and previous >= step else None
    if kept is not None:
        log.warning("%s%s already holds a verified copy of step %d: kept; the state of step %d is not written over it", describe, path, kept["step"], step)
        return kept
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=PRIVATE_DIR_MODE, exist_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, STATE_FILE_MODE), "wb") as f:  # the user's model: the user's only
            torch.save({"format": FORMAT, "meta": meta, "entries": {n: t.detach().cpu() for n, t in entries}, "sha256": sha}, f)
            f.flush()
            os.fsync(f.fileno())
        read(tmp, sha)  # what is on disk is what was meant, before it replaces anything
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except OSError as e:
        remove_quietly(tmp)
        raise EmergencyCopyError(f"cannot write the state of step {step} to {path}: {write_failure(e, path)}. {_previous(previous, path)}") from None
    except EmergencyCopyError as e:
        remove_quietly(tmp)
        raise EmergencyCopyError(f"the copy of step {step} read back damaged ({e}); {_previous(previous, path)}") from None
    except RuntimeError as e:  # torch's writer wraps the OSError of a failed write
        remove_quietly(tmp)
        cause = _os_error_in(e)
        why = write_failure(cause, path) if cause is not None else f"{e}. HINT: check the filesystem holding {os.path.dirname(path)}"
        raise EmergencyCopyError(f"cannot write the state of step {step} to {path}: {why}. {_previous(previous, path)}") from None
    rec = record_of(path, meta, sha, True)
    log.info("%sstate of step %d written to %s (%.1f MB, sha256 %s)", describe, step, path, rec["bytes"] / 1e6, sha[:12])
    return rec


def read(path: str, sha256: Optional[str] = None) -> Tuple[Entries, Dict[str, Any]]:
    """The state held in the copy at ``path``, checked against its own checksum and against
    ``sha256`` (the one recorded when it was written) where given; ``EmergencyCopyError`` if the
    file is missing, truncated or altered: a damaged copy is never loaded."""
    entries, meta, _ = _checked(path, sha256)
    return entries, meta


def read_checked(path: str, sha256: Optional[str] = None) -> Tuple[Entries, Dict[str, Any], str]:
    """:func:`read`, and the sha256 of the state read (what an index records for it)."""
    return _checked(path, sha256)


def _checked(path: str, sha256: Optional[str]) -> Tuple[Entries, Dict[str, Any], str]:
    hint = 'HINT: a damaged copy is never loaded; restore the file from a backup, or start the job afresh without it (remove the "saved" entry from RUN_DIR/restart.json)'
    if not os.path.exists(path):
        raise EmergencyCopyError(f"the emergency copy {path} is missing. {hint}")
    try:
        data = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a truncated zip, a short read, garbage: all mean damaged
        raise EmergencyCopyError(f"the emergency copy {path} ({os.path.getsize(path)} bytes) is damaged or truncated: {str(e).splitlines()[0][:200]}. {hint}") from None
    if not isinstance(data, dict) or not {"meta", "entries"} <= set(data):
        raise EmergencyCopyError(f"{path} is not an emergency copy (no meta/entries). {hint}")
    entries = list(data["entries"].items())
    meta = data["meta"]
    got = state_sha256(entries, meta)
    embedded = data.get("sha256")
    if embedded is not None and got != embedded:
        raise EmergencyCopyError(f"the emergency copy {path} is damaged: its contents hash to {got[:12]}, it was written as {embedded[:12]}. {hint}")
    if sha256 is not None and got != sha256:
        raise EmergencyCopyError(f"the emergency copy {path} does not match the sha256 recorded for it ({got[:12]} != {sha256[:12]}): altered or replaced. {hint}")
    return entries, meta, got


def step_of(path: str) -> Optional[int]:
    """The step a copy says it holds, unchecked and without reading its tensors (mapped); None
    when there is no readable copy. Only a copy as new as the one to write is then checked in
    full: an older one is replaced anyway."""
    try:
        return int(torch.load(path, weights_only=True, mmap=True, map_location="cpu")["meta"]["step"])
    except Exception:  # noqa: BLE001 - missing, truncated, not ours: no step
        return None


def existing(path: str) -> Optional[Dict[str, Any]]:
    """The record of the verified copy at ``path`` (``written: False``), or None when there is
    none or it is damaged (a damaged copy protects nothing: it may be replaced)."""
    if not os.path.exists(path):
        return None
    try:
        _, meta, sha = _checked(path, None)
    except EmergencyCopyError as e:
        log.warning("the copy already at %s cannot be used and may be replaced: %s", path, e)
        return None
    return record_of(path, meta, sha, False)


def _previous(step: Optional[int], path: str) -> str:
    if step is not None:
        return f"The previous copy (step {step}) at {path} is untouched."
    return f"Nothing was written to {path}."


def _os_error_in(e: BaseException) -> Optional[OSError]:
    seen = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    for code in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EFBIG):
        if os.strerror(code) in text:
            return OSError(code, os.strerror(code))
    return None
