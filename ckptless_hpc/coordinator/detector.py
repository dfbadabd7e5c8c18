"""Failure detection by missed heartbeats: pure functions of (now, last seen, timeout, stalls).

A stall of the coordinator itself (an event-loop callback that ran long, a garbage-collection
pause, the machine swapping) must never make a live worker look silent: its heartbeats were
sent, they were only not read yet. So silence is measured in the coordinator's awake time:
the watchdog measures how late its own ticks come (``StallMeter``), and the stalls since a
worker was last heard are subtracted from that worker's silence. A worker whose bytes are
waiting unread is not silent either (``pending``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple


@dataclass
class StallMeter:
    """The coordinator's own stalls, from the watchdog's ticks (one every ``interval_s``).

    A tick up to one interval late is ordinary scheduling jitter on a loaded machine (the
    heartbeat timeout spans several intervals); what comes later than that is a stall, and
    counts in full beyond that tolerance.
    """

    interval_s: float
    last_tick: float
    stalled_s: float = 0.0  # all the stalls seen so far
    worst_s: float = 0.0

    def tick(self, now: float) -> float:
        """Called by the watchdog when it wakes; returns the stall this tick reveals (>= 0)."""
        stall = max(0.0, now - self.last_tick - 2 * self.interval_s)
        self.stalled_s += stall
        self.worst_s = max(self.worst_s, stall)
        self.last_tick = now
        return stall


def silent_workers(
    now: float,
    last_seen: Mapping[str, float],
    watched: Iterable[str],
    timeout_s: float,
    stalled_s: float = 0.0,
    stalled_when_seen: Optional[Mapping[str, float]] = None,
    pending: Callable[[str], bool] = lambda w: False,
) -> List[Tuple[str, str]]:
    """Watched workers silent for longer than ``timeout_s`` of the coordinator's awake time
    (wall time since last heard, less the coordinator's stalls since then), with no bytes
    waiting to be read from them; each with a readable reason."""
    out = []
    for w in watched:
        seen = last_seen.get(w)
        if seen is None:
            continue
        stalls = stalled_s - (stalled_when_seen or {}).get(w, stalled_s)
        silence = now - seen - stalls
        if silence > timeout_s and not pending(w):
            why = f"no heartbeat for {now - seen:.1f}s (timeout {timeout_s:.1f}s"
            out.append((w, why + (f"; the coordinator itself stalled {stalls:.1f}s of it)" if stalls > 0.05 else ")")))
    return out


def stragglers(compute_s: Mapping[int, float], factor: float) -> Dict[int, float]:
    """Ranks whose step compute time exceeds ``factor`` x the typical rank's (lower median).

    A straggler is alive and beating: it is reported, never declared dead.
    """
    times = [t for t in compute_s.values() if t and t > 0]
    if len(times) < 2:
        return {}
    typical = statistics.median_low(times)
    return {r: t / typical for r, t in compute_s.items() if t and t > factor * typical}
