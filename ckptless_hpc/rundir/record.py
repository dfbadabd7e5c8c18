"""Writing the run record (summary.json, restart.json, events.jsonl, the logs) safely.

The run record describes the job; it is never the job. A full disk, a quota or a read-only
run directory must not end, wedge or hide a job that trains fine, so every writer here reports
a failure instead of raising it into the coordinator's control handlers:

- ``atomic_write(path, data)`` replaces a file in one step (a temporary file next to it,
  fsynced, renamed over it, the directory fsynced): a reader sees the old file or the new one,
  and a write that fails leaves the old one untouched and no temporary file behind; it raises
  :class:`RecordError`, whose message names the path, what was wrong and the fix.
- ``dumps(obj)`` is strict JSON (RFC 8259): a non-finite float becomes the string ``"nan"``,
  ``"inf"`` or ``"-inf"`` (``float()`` reads each back), never a bare ``NaN`` token.
- ``write_failure(e, path)`` says why ``path`` could not be written and what to do.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
from typing import Any, Dict, List, Optional

from .paths import HYDRA

log = logging.getLogger("ckptless_hpc.rundir.record")

#: Files that hold a model's state (the emergency copy, its shards): the owner's only.
STATE_FILE_MODE = 0o600
#: Directories a job creates for itself (its run directory, state/): the owner's only.
PRIVATE_DIR_MODE = 0o700


class RecordError(OSError):
    """A file of the run record could not be written; the message names the path and the fix."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0])


def write_failure(e: BaseException, path: str) -> str:
    """Why ``path`` could not be written (from the OSError ``e``), with a HINT naming the fix."""
    where = os.path.dirname(path) or "."
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the filesystem holding {where}. HINT: free space there (or raise the quota), or run with hydra.run.dir on a filesystem with room"
    if code == errno.EROFS:
        return f"{where} is on a read-only filesystem. HINT: run with hydra.run.dir on a writable filesystem (or remount it read-write)"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied in {where}. HINT: make it writable for this user, or run with hydra.run.dir on a directory it can write"
    if code == errno.EFBIG:
        return f"the file size limit was reached writing in {where}. HINT: raise the limit (ulimit -f) for the job"
    return f"{getattr(e, 'strerror', None) or e}. HINT: check the filesystem holding {where}, or run with hydra.run.dir elsewhere"


class Failures:
    """The run record's write failures of one job, each path said once (on a full disk every
    write after the first fails too): logged as errors, kept for the summary and the console."""

    def __init__(self) -> None:
        self.by_path: Dict[str, str] = {}

    def report(self, path: str, message: str) -> None:
        if path not in self.by_path:
            self.by_path[path] = message
            log.error("%s", message)

    @property
    def messages(self) -> List[str]:
        return list(self.by_path.values())


class RecordFileHandler(logging.FileHandler):
    """A log file of the run record: a write that fails is said once on stderr (path and fix),
    then the file is left alone; the other handlers (the console) go on. logging's own
    handleError would print a traceback for every later line."""

    def __init__(self, path: str) -> None:
        super().__init__(path, encoding="utf-8")
        self.error: Optional[str] = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is None:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if self.error is not None or not isinstance(e, OSError):
            return super().handleError(record) if self.error is None else None
        self.error = f"cannot write {self.baseFilename}: {write_failure(e, self.baseFilename)}; its later lines are on the console only"
        sys.stderr.write(f"ckptless_hpc: {self.error}\n")
        try:
            self.close()
        except OSError:  # its buffer cannot be flushed either
            pass


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its name (``"nan"``, ``"inf"``, ``"-inf"``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON text of ``obj`` (non-finite floats as strings; the common case costs one pass)."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:  # a non-finite float somewhere: name it (a circular structure raises again)
        return json.dumps(strict(obj), allow_nan=False, **kw)


def atomic_write(path: str, data: bytes, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` in one step; :class:`RecordError` (``path`` untouched) when
    it cannot. ``mode`` is the new file's (the umask applies)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except OSError as e:
        remove_quietly(tmp)
        raise RecordError(path, f"cannot write {path}: {write_failure(e, path)}") from None


def write_json(path: str, obj: Any, mode: int = 0o666) -> None:
    """``atomic_write`` of ``obj`` as strict, indented JSON."""
    atomic_write(path, (dumps(obj, indent=2) + "\n").encode(), mode)


def make_private(run_dir: str) -> None:
    """The run directory the job was just given (it holds only Hydra's files): the owner's only
    (0700), as the state inside it is. A directory that already held something is left as it is."""
    try:
        if all(n == HYDRA or n.endswith(".log") for n in os.listdir(run_dir)):
            os.chmod(run_dir, PRIVATE_DIR_MODE)
    except OSError:  # not ours to change: the files in it keep their own modes
        pass


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass
