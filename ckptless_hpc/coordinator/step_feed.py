"""Rank 0's per-step metrics, as decisions apart from what is done with them: the bounded step
log, the end of a recovery (the job has resumed once a step past its target is committed, and
the spares it used are refilled then), and the progress line's figures. No sockets, no files:
time is an argument; the coordinator writes the events, TensorBoard and the console.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from ..metrics import Recovery, StepLog, goodput
from ..progress import Snapshot
from ..control.messages import Metrics

CENSUS_EVERY_S = 0.5


def resumed(recovery: Optional[Recovery], step: int) -> bool:
    """Has the job resumed after ``recovery``: is ``step`` past the step it re-formed at?"""
    return recovery is not None and recovery.target_step is not None and step > recovery.target_step


@dataclass(frozen=True)
class Resumed:
    """A recovery ended by a committed step: its record (``t_resumed`` set) and the spares to refill now."""

    recovery: Recovery
    refills: int


class HeadCount:
    """(alive ranks, spares) for the progress line: counted (O(world)) at most every ``every_s``, not per step."""

    def __init__(self, census: Callable[[], Tuple[int, int]], every_s: float = CENSUS_EVERY_S) -> None:
        self.census = census
        self.every_s = every_s
        self.last: Tuple[float, int, int] = (-1.0, 0, 0)  # (when, alive, spares)

    def __call__(self, now: float) -> Tuple[int, int]:
        when, alive, spares = self.last
        if now - when >= self.every_s or now < when:
            alive, spares = self.census()
            self.last = (now, alive, spares)
        return alive, spares


class StepFeed:
    """Fed every ``metrics`` message with the time it was read; O(1) per step at any step count."""

    def __init__(self, steps: StepLog, total_steps: int, world: int, census: Callable[[], Tuple[int, int]]) -> None:
        self.steps = steps
        self.total_steps = total_steps
        self.world = world
        self.head_count = HeadCount(census)
        self.resuming: Optional[Recovery] = None  # the last recovery, until a step past its target is committed
        self.refills_due = 0  # spares used since the job last resumed, started once it has

    def reformed(self, recovery: Recovery, refills: int) -> None:
        """A recovery re-formed the job; ``refills`` spares to start once it resumes (not sooner:
        a process start must not compete with that first step where nodes share cores)."""
        self.resuming = recovery
        self.refills_due += refills

    def on_step(self, m: Metrics, now: float) -> Optional[Resumed]:
        """Log the step; the recovery it ends, if it ends one."""
        self.steps.add(m.step, m.loss, m.step_s)
        r = self.resuming
        if r is None or not resumed(r, m.step):
            return None
        r.t_resumed = now
        out = Resumed(r, self.refills_due)
        self.resuming, self.refills_due = None, 0
        return out

    def snapshot(self, m: Metrics, now: float, t_train: Optional[float], recoveries: int, gen: int) -> Snapshot:
        """The progress line after step ``m`` (``t_train``: when training started; None: not yet)."""
        steps_per_s = self.steps.steps_per_s(m.step)
        alive, spares = self.head_count(now)
        return Snapshot(
            step=m.step,
            total=self.total_steps,
            loss=float(m.loss),
            samples_per_s=m.samples * steps_per_s if m.samples else None,
            steps_per_s=steps_per_s,
            alive=alive,
            world=self.world,
            spares=spares,
            recoveries=recoveries,
            goodput=goodput(self.steps.productive_s, now - (t_train or now)),
            gen=gen,
            metrics=m.metrics,
        )
