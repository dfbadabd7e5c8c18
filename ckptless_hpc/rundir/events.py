"""events.jsonl: its writer (the coordinator's :class:`EventLog`) and its reader
(:func:`parse_events`, :func:`split_attempts`), from one field list.

Every event is one strict-JSON object per line that opens with the :data:`HEADER` fields, in
that order: what happened (``event``), when (``time``, epoch s; ``t``, s since this attempt's
coordinator started), and who (``job``, ``gen``, ``rank``, ``node``, ``step``; None where it
does not apply). The fields of each kind follow. A requeued Slurm job appends to the same file:
each coordinator start (an *attempt*) opens with a :data:`ATTEMPT_START` event.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .paths import EVENTS, RunPaths
from .record import dumps, write_failure

Event = Dict[str, Any]

#: The fields every event opens with, in this order (the writer's order; what readers may rely on).
HEADER = ("event", "time", "t", "job", "gen", "rank", "node", "step")
#: The event each attempt (coordinator start) opens with.
ATTEMPT_START = "job_started"


class RunDirError(ValueError):
    """A path that is not (or not yet) a readable run directory; the message has a HINT."""


# ------------------------------------------------------------------------------ writer
class EventLog:
    """One strict-JSON object per line; every event says job, generation, rank, node and step.

    A write that fails (a full disk, a quota, a read-only or vanished run directory) never
    raises into the caller, which is a control handler: the log stops there (what is on disk
    stays readable; at most its last line is torn, and readers skip a torn last line), and
    ``on_error(path, message)`` is told once, the message naming the path and the fix.
    """

    def __init__(self, path: str, job: str, clock: Any = time.time, on_error: Optional[Callable[[str, str], None]] = None) -> None:
        self.path = path
        self._fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self.job = job
        self._clock = clock
        self.t0 = clock()
        self.on_error = on_error
        self.error: Optional[str] = None

    @classmethod
    def in_run_dir(cls, run_dir: str, job: str, clock: Any = time.time, on_error: Optional[Callable[[str, str], None]] = None) -> "EventLog":
        """The event log of the run directory ``run_dir`` (appended to: a requeue adds an attempt)."""
        return cls(RunPaths(run_dir).events, job, clock, on_error)

    def emit(
        self,
        event: str,
        *,
        gen: Optional[int] = None,
        rank: Optional[int] = None,
        node: Optional[str] = None,
        step: Optional[int] = None,
        at: Optional[float] = None,
        **fields: Any,
    ) -> Dict[str, Any]:
        """Append one event; ``at`` is when it happened (default now), so that an event and the
        figures computed from the same instant carry one time."""
        now = self._clock() if at is None else at
        rec = dict(zip(HEADER, (event, round(now, 6), round(now - self.t0, 6), self.job, gen, rank, node, step)))
        rec.update(fields)
        if self._fd is not None:
            self._write((dumps(rec, separators=(",", ":"), default=str) + "\n").encode())
        return rec

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        try:
            view = memoryview(data)
            while view:  # a short write (the disk filled up mid-line) is followed by the real error
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            self.error = f"cannot write {self.path}: {write_failure(e, self.path)}; the events after this one are not recorded"
            self.close()
            if self.on_error is not None:
                self.on_error(self.path, self.error)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# ------------------------------------------------------------------------------ reader
def parse_events(text: str) -> List[Event]:
    """One event per line; a torn last line (the job is still writing it) is skipped."""
    events = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise RunDirError(f"{EVENTS} line {i + 1} is not JSON: {line[:80]!r}. HINT: the file was edited or truncated") from None
    return events


def read_events(run_dir: str) -> List[Event]:
    """Every event of ``run_dir`` so far (all attempts); [] before the coordinator started."""
    try:
        with open(RunPaths(run_dir).events, encoding="utf-8", errors="replace") as f:
            return parse_events(f.read())
    except FileNotFoundError:
        return []


def split_attempts(events: Sequence[Event]) -> List[List[Event]]:
    """Events grouped per coordinator start (each attempt opens with :data:`ATTEMPT_START`)."""
    out: List[List[Event]] = []
    for e in events:
        if e.get("event") == ATTEMPT_START or not out:
            out.append([])
        out[-1].append(e)
    return out
