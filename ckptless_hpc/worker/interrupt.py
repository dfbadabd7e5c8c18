"""Waiting for something the worker does not control (a collective, a formation, a fetch) in a
way the coordinator can cut short: an ``abort`` of a newer generation, a ``stop``, or the loss of
the coordinator wakes the wait, which then raises ``Aborted``; a bound that passes raises
``CollectiveError``."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict


class Aborted(Exception):
    """The coordinator started a new generation; the in-flight work is abandoned."""


class CollectiveError(Exception):
    """A collective failed or timed out (a peer died or hung)."""


class Interruptible:
    """Mixed into the worker: its ``abort_gen``, ``_stopping``, ``_orphaned`` and ``_wake``."""

    abort_gen: int
    _stopping: bool
    _orphaned: Any
    _wake: threading.Event

    def _wait_until(self, done: Callable[[], bool], gen: int, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            if done():
                return "done"
            if self.abort_gen > gen or self._stopping or self._orphaned:
                return "abort"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            self._wake.wait(remaining)
            self._wake.clear()

    def _interruptible(self, fn: Callable[[], Any], gen: int, timeout_s: float, what: str) -> Any:
        box: Dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
            finally:
                box["done"] = True
                self._wake.set()

        threading.Thread(target=run, name=what, daemon=True).start()
        outcome = self._wait_until(lambda: "done" in box, gen, timeout_s)
        if outcome == "abort":
            raise Aborted(what)
        if outcome == "timeout":
            raise CollectiveError(f"{what} timed out after {timeout_s:.1f}s")
        if "error" in box:
            raise box["error"]
        return box["value"]
