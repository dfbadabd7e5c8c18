"""The coordinator's view of its workers' health between messages: heartbeat delays, its own
stalls, each rank's compute times (detector.py decides who is silent or a straggler). The
control server feeds it from heartbeats; the shell asks it once per heartbeat interval."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Tuple

from ..metrics import DelayHistogram
from .detector import StallMeter, StragglerWatch, StragglerWindow, silent_workers


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

    def stragglers(self, active: Mapping[int, str]) -> Tuple[Dict[int, float], List[int]]:
        return self.straggler_watch.judge(active)
