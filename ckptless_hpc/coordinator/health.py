"""The coordinator's view of its workers' health between messages: heartbeat delays, its own
stalls, each rank's compute times (detector.py decides who is silent or a straggler). The
control server feeds it from heartbeats; the shell asks it once per heartbeat interval."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Dict, List, Mapping, Tuple

from ..metrics import DelayHistogram
from .detector import StallMeter, StragglerWatch, StragglerWindow, silent_workers

log = logging.getLogger("ckptless_hpc.coordinator")


class Health:
    def __init__(self, heartbeat_interval_s: float, heartbeat_timeout_s: float, straggler_factor: float, now: float) -> None:
        self.timeout_s = heartbeat_timeout_s
        self.stalls = StallMeter(heartbeat_interval_s, now)
        self.straggling = StragglerWindow()  # compute times per worker, from heartbeats
        self.straggler_watch = StragglerWatch(self.straggling, straggler_factor)
        self.hb_delay = DelayHistogram()  # heartbeat sent (worker's clock) -> read here

    @classmethod
    def from_cluster(cls, c: Any, now: float) -> "Health":
        return cls(c.heartbeat_interval_s, c.heartbeat_timeout_s, c.straggler_factor, now)

    def silent(self, now: float, live: List[Any], unread: Callable[[str], bool]) -> List[Tuple[str, str]]:
        """(worker, reason) of the built workers silent too long, net of the coordinator's own stalls."""
        seen = {w.wid: w.last_seen for w in live}
        at = {w.wid: w.seen_stall for w in live}
        return silent_workers(now, seen, seen.keys(), self.timeout_s, self.stalls.stalled_s, at, unread)

    def report_stragglers(self, ranks: Mapping[int, str], workers: Mapping[str, Any], emit: Callable[..., Any]) -> Tuple[Dict[int, float], List[int]]:
        """Stragglers are reported, never failed: an event when a rank becomes one and when it
        recovers; (ranks newly slow -> ratio, ranks no longer slow), for cluster.straggler_action."""
        active = {r: w for r, w in ranks.items() if workers[w].role == "active"}
        slow, cleared = self.straggler_watch.judge(active)
        for r, ratio in slow.items():
            emit("straggler", workers[active[r]], ratio=round(ratio, 2), compute_s=self.straggling.times[active[r]], window=self.straggling.size)
            log.warning("rank %d is a straggler: %.1fx slower than the typical rank", r, ratio)
        for r in cleared:
            if r in ranks:
                emit("straggler_recovered", workers[ranks[r]])
        return slow, cleared

    async def watch(self, clock: Callable[[], float], interval_s: float, stopping: Callable[[], bool], judge: Callable[[float], None], emit: Callable[..., Any]) -> None:
        """Every ``interval_s`` until ``stopping()``: measure the loop's own stall, then ``judge(now)``
        net of it (what arrived during a stall is read first)."""
        self.stalls.last_tick = clock()
        while not stopping():
            await asyncio.sleep(interval_s)
            late = self.stalls.tick(clock())
            if late > interval_s:
                emit("coordinator_stalled", seconds=round(late, 3))
                log.warning("the coordinator itself stalled for %.2fs: not counted as any worker's silence", late)
            await asyncio.sleep(0)  # what arrived during a stall is read before anyone is judged
            judge(self.stalls.last_tick)
