"""Waiting for something the worker does not control (a collective, a formation, a fetch) in a
way the coordinator can cut short: an ``abort`` of a newer generation, a ``stop``, or the loss of
the coordinator wakes the wait, which then raises ``Aborted``; a bound that passes raises
``CollectiveError``."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple


class Aborted(Exception):
    """The coordinator started a new generation; the in-flight work is abandoned."""


class CollectiveError(Exception):
    """A collective failed or timed out (a peer died or hung)."""


class Waiter:
    """What cuts a wait short, and the event that wakes it: set from the control reader thread
    (``abort``, ``stop``, the coordinator lost), read by the main thread between wake-ups."""

    def __init__(self) -> None:
        self.abort_gen = -1
        self.stopping = False
        self.orphaned: Optional[str] = None  # the coordinator is gone (Slurm: save and requeue)
        self.wake = threading.Event()
        self.hold: Optional[Tuple[int, int]] = None  # a planned move's (generation, step): an abort once that step is committed
        self.step = -1  # the committed step (the main thread's, after each commit)

    def abort(self, gen: int) -> None:
        self.abort_gen = max(self.abort_gen, gen)
        self.wake.set()

    def hold_at(self, gen: int, step: int) -> None:
        """A planned move (``abort`` with ``at_step``): generation ``gen`` starts at ``step``, so
        no step past it is taken: the abort of ``gen`` takes effect once ``step`` is committed (at
        once when it is already; a step in flight past it is then abandoned, as its peers hold)."""
        self.hold = (gen, step)
        self._check()

    def committed(self, step: int) -> None:
        self.step = step
        self._check()

    def _check(self) -> None:
        hold = self.hold  # read once: the reader thread may replace it meanwhile
        if hold is not None and self.step >= hold[1] and hold[0] > self.abort_gen:
            self.abort(hold[0])

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def orphan(self, why: str) -> None:
        self.orphaned = why
        self.wake.set()

    def cut(self, gen: int) -> bool:
        """Whether work of generation ``gen`` is to be abandoned (a newer abort, a stop, no coordinator)."""
        return self.abort_gen > gen or self.stopping or bool(self.orphaned)

    def wait_until(self, done: Callable[[], bool], gen: int, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            if done():
                return "done"
            if self.cut(gen):
                return "abort"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            self.wake.wait(remaining)
            self.wake.clear()

    def run(self, fn: Callable[[], Any], gen: int, timeout_s: float, what: str) -> Any:
        """``fn()`` in a thread of its own, waited on as :meth:`wait_until` waits."""
        box: Dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
            finally:
                box["done"] = True
                self.wake.set()

        threading.Thread(target=run, name=what, daemon=True).start()
        outcome = self.wait_until(lambda: "done" in box, gen, timeout_s)
        if outcome == "abort":
            raise Aborted(what)
        if outcome == "timeout":
            raise CollectiveError(f"{what} timed out after {timeout_s:.1f}s")
        if "error" in box:
            raise box["error"]
        return box["value"]
