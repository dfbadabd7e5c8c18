"""Scheduler commands off the coordinator's event loop, in order, after the promotion.

slurmctld can take seconds to answer for a node that does not respond (a ``scancel`` of a
crashed node's step took 6 s on the mini-cluster): no such call may run inside the
coordinator's loop, where it would stop every heartbeat and the recovery with it. A launcher
queues its commands here; one thread runs them one at a time, in the order they were queued,
and reports each outcome (what, how long, the error) to a callback.

``hold()`` keeps queued commands waiting (a recovery is being planned: nothing that it does
needs the scheduler) until ``release()`` (the promotion has been sent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional

from ..coordinator.scheduler_log import describe, event_fields  # noqa: F401  (the outcome's event and log line)

log = logging.getLogger("ckptless_hpc.launch")

Report = Callable[[Dict[str, Any]], None]


@dataclass
class Command:
    """One scheduler call: ``run()`` raises on failure; ``context`` names job, node, step."""

    action: str
    run: Callable[[], Any]
    context: Dict[str, Any] = field(default_factory=dict)
    queued_at: float = 0.0


class CommandQueue:
    """A single worker thread running queued commands in order; see the module docstring."""

    def __init__(self, report: Optional[Report] = None, clock: Callable[[], float] = time.time, name: str = "scheduler-commands") -> None:
        self.report = report
        self.clock = clock
        self._name = name
        self._queue: Deque[Command] = deque()
        self._cv = threading.Condition()
        self._held = False
        self._busy = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self.outcomes: List[Dict[str, Any]] = []  # every outcome, in the order they finished

    def submit(self, action: str, run: Callable[[], Any], **context: Any) -> None:
        """Queue one command; never blocks (the thread starts on the first command)."""
        with self._cv:
            if self._closed:
                log.warning("%s %s not run: the command queue is closed", action, context)
                return
            self._queue.append(Command(action, run, context, self.clock()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def hold(self) -> None:
        """Queued commands wait (the running one, if any, finishes) until ``release()``."""
        with self._cv:
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    @property
    def held(self) -> bool:
        return self._held

    def pending(self) -> int:
        """Commands queued or running."""
        with self._cv:
            return len(self._queue) + (1 if self._busy else 0)

    def flush(self, timeout_s: float) -> bool:
        """Release the hold and wait up to ``timeout_s`` until every queued command has run
        (before a command that must come after them, e.g. a requeue after a drain). True when
        the queue is empty. From any thread but the queue's own."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._held = False
            self._cv.notify_all()
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            done = not self._queue and not self._busy
        if not done:
            log.warning("%d scheduler command(s) still queued or running after %.0f s: %s", self.pending(), timeout_s, [c.action for c in self._queue])
        return done

    def drain(self, timeout_s: float) -> bool:
        """``flush``, then close the queue (a later ``submit`` is refused and logged)."""
        done = self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        return done

    def _next(self) -> Optional[Command]:
        with self._cv:
            while not self._closed and (self._held or not self._queue):
                self._cv.wait()
            if not self._queue:  # closed and empty
                return None
            self._busy = True
            return self._queue.popleft()

    def _loop(self) -> None:
        while True:
            cmd = self._next()
            if cmd is None:
                return
            outcome = self._run(cmd)
            with self._cv:
                self._busy = False
                self.outcomes.append(outcome)
                self._cv.notify_all()
            if self.report is not None:
                try:
                    self.report(outcome)
                except Exception:  # a report must never stop the commands behind it
                    log.exception("reporting the outcome of %s failed", cmd.action)

    def _run(self, cmd: Command) -> Dict[str, Any]:
        started = self.clock()
        error: Optional[str] = None
        try:
            cmd.run()
        except Exception as e:  # any failure is reported, never raised into the thread
            error = str(e) or type(e).__name__
        finished = self.clock()
        return {
            "action": cmd.action,
            **cmd.context,
            "ok": error is None,
            "error": error,
            "queued_at": round(cmd.queued_at, 6),
            "started_at": round(started, 6),
            "finished_at": round(finished, 6),
            "waited_s": round(started - cmd.queued_at, 4),
            "seconds": round(finished - started, 4),
        }
