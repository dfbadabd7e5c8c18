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
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Tuple


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


STRAGGLER_WINDOW = 8  # compute-time samples kept per worker (one per step seen in its heartbeats)
STRAGGLER_MIN_SAMPLES = 6  # a worker is judged only on at least this many samples


class StragglerWindow:
    """Compute times per worker, judged over a window, never on one sample.

    Fed (worker, step, compute_s) from heartbeats: a sample counts once per step (a heartbeat
    repeating the last step's time adds nothing), the last ``size`` are kept, and the window's
    lower quartile is kept up to date as they arrive (O(size log size) per heartbeat, O(1) in
    the world size). Noise only ever adds time (a noisy neighbour, a page fault, the scheduler
    taking the core away), so the time a rank takes at least three steps in four is its speed:
    a healthy rank is flagged only if nearly every sample of its window was hit, while a rank
    slow step after step is flagged as soon as it has ``min_samples`` samples.
    """

    def __init__(self, size: int = STRAGGLER_WINDOW, min_samples: int = STRAGGLER_MIN_SAMPLES) -> None:
        if not 1 <= min_samples <= size:
            raise ValueError(f"StragglerWindow: min_samples={min_samples} must be in [1, size={size}]")
        self.size = size
        self.min_samples = min_samples
        self._samples: Dict[str, Deque[float]] = {}
        self._last_step: Dict[str, Any] = {}
        self.times: Dict[str, float] = {}  # worker -> its window's lower quartile, once it has min_samples

    def add(self, worker: str, step: Any, compute_s: Optional[float]) -> None:
        if compute_s is None or not compute_s > 0 or step is None or self._last_step.get(worker) == step:
            return
        self._last_step[worker] = step
        window = self._samples.setdefault(worker, deque(maxlen=self.size))
        window.append(float(compute_s))
        if len(window) >= self.min_samples:
            self.times[worker] = sorted(window)[len(window) // 4]

    def forget(self, worker: str) -> None:
        for d in (self._samples, self._last_step, self.times):
            d.pop(worker, None)

    def judge(self, ranks: Mapping[int, str], factor: float, flagged: Iterable[int] = ()) -> Dict[int, float]:
        """Ranks (of ``ranks``: rank -> worker) whose windowed compute time exceeds ``factor`` x
        the typical rank's (the lower median over the ranks), with the ratio. A rank already
        ``flagged`` stays so until its ratio falls below halfway to 1 (no flapping at the line)."""
        times = {r: self.times.get(w) for r, w in ranks.items()}
        slow = stragglers(times, factor)
        release = 1 + (factor - 1) / 2
        for r, ratio in stragglers(times, release).items():
            if r in flagged:
                slow.setdefault(r, ratio)
        return slow


class StragglerWatch:
    """Which ranks became stragglers, and which stopped being, from one judgement of a
    ``StragglerWindow`` to the next (each change is reported once, not every tick)."""

    def __init__(self, window: StragglerWindow, factor: float) -> None:
        self.window = window
        self.factor = factor
        self.slow: Dict[int, float] = {}  # rank -> ratio, as last judged

    def judge(self, active: Mapping[int, str]) -> Tuple[Dict[int, float], List[int]]:
        """(ranks newly slow -> ratio, ranks no longer slow) among ``active`` (rank -> worker)."""
        slow = self.window.judge(active, self.factor, self.slow)
        new = {r: ratio for r, ratio in slow.items() if r not in self.slow}
        cleared = sorted(set(self.slow) - set(slow))
        self.slow = slow
        return new, cleared


def stragglers(compute_s: Mapping[int, Optional[float]], factor: float) -> Dict[int, float]:
    """Ranks whose compute time (a window's: ``StragglerWindow``) exceeds ``factor`` x the
    typical rank's (lower median); ranks without a time are not judged, nor counted.

    A straggler is alive and beating: it is reported, never declared dead.
    """
    times = [t for t in compute_s.values() if t and t > 0]
    if len(times) < 2:
        return {}
    typical = statistics.median_low(times)
    return {r: t / typical for r, t in compute_s.items() if t and t > factor * typical}
