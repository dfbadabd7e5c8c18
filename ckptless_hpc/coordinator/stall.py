"""A job that commits no step: the pure watch (train.stall_timeout_s).

Every wait of a worker has its own bound; this is the job's: while it trains (not while it
recovers, saves or starts), the time since the last committed step (or since training or the
generation started) must stay under a limit, ``train.stall_timeout_s`` or, when that is null, a
multiple of the measured step time (``FACTOR`` x the median of the last ``WINDOW`` steps, never
under ``FLOOR_S``: a first step, an evaluation or a slow copy is not a stall). Past it the job is
ended with what was last seen. Time is an argument: tests move it."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Deque, Optional

FLOOR_S = 120.0
FACTOR = 50.0
WINDOW = 20


class StallWatch:
    def __init__(self, timeout_s: Optional[float] = None) -> None:
        self.timeout_s = timeout_s
        self.since: Optional[float] = None  # the last commit, or the start of training or of a generation
        self.step: Optional[int] = None
        self._step_s: Deque[float] = deque(maxlen=WINDOW)

    def start(self, now: float) -> None:
        """Training started, or a recovery ended: the clock runs from here."""
        self.since = now

    def committed(self, step: int, now: float, step_s: Optional[float]) -> None:
        self.since, self.step = now, step
        if step_s is not None and step_s > 0:
            self._step_s.append(float(step_s))

    def limit_s(self) -> float:
        if self.timeout_s is not None:
            return float(self.timeout_s)
        typical = statistics.median(self._step_s) if self._step_s else 0.0
        return max(FLOOR_S, FACTOR * typical)

    def deadline(self) -> Optional[float]:
        return None if self.since is None else self.since + self.limit_s()

    def overdue(self, now: float) -> Optional[str]:
        """Why the job is stalled at ``now``, or None."""
        d = self.deadline()
        if d is None or now < d:
            return None
        what = f"after step {self.step}" if self.step is not None else "since training started"
        how = "train.stall_timeout_s" if self.timeout_s is not None else f"{FACTOR:g} x the median step time, at least {FLOOR_S:g} s (train.stall_timeout_s=null)"
        return (
            f"the job committed no step for {now - self.since:.0f} s {what} (limit {self.limit_s():.0f} s: {how}); no worker reported a failure. "
            "HINT: the workers' logs (ckptless-hpc logs RUN_DIR) show where each rank waits; raise train.stall_timeout_s if steps this slow are expected"
        )
