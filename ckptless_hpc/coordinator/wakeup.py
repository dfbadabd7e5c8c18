"""Waiting on the coordinator's state: a coroutine waits ``until`` a condition holds; whatever
changes that state calls ``notify``, which wakes the waiters once per loop iteration, not once
per message (ten thousand heartbeats in one iteration are one wake-up)."""

from __future__ import annotations

import asyncio
from typing import Callable, List, Optional


class Wakeup:
    def __init__(self) -> None:
        self._waiters: List["asyncio.Future[None]"] = []
        self._due = False

    def notify(self) -> None:
        """Something changed: wake the waiters (soon, once, where a loop runs; at once otherwise)."""
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test driving the decisions directly)
            return self._wake()
        self._due = True
        loop.call_soon(self._wake)

    def _wake(self) -> None:
        self._due = False
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def until(self, cond: Callable[[], bool], timeout_s: Optional[float]) -> bool:
        """Wait until ``cond()`` (checked on each wake-up); False if ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not cond():
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
        return True
