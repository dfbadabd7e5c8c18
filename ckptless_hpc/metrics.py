"""Recovery phase timings, rank 0's step figures, delay histograms and goodput arithmetic: pure
figures, no I/O (what a run writes is rundir/'s: the event log in rundir/events.py, the
TensorBoard curves in rundir/tensorboard.py)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class Recovery:
    """One recovery: what failed, what replaced it, and what each phase cost (seconds)."""

    gen: int
    failed_ranks: List[int]
    failed_nodes: List[str]
    failed_workers: List[str]
    reasons: List[str]
    t_fail: float
    t_detect: float
    replacements: Dict[str, str] = field(default_factory=dict)  # rank -> worker
    target_step: Optional[int] = None
    t_ready: Optional[float] = None
    t_resumed: Optional[float] = None
    transfer_s: float = 0.0
    bytes_transferred: int = 0
    survivors_restarted: int = 0  # survivors whose process is not the one launched for them (continuity.py)
    survivors_checked: int = 0  # survivors whose process identity was measured from outside
    attempts: int = 1
    planned: Optional[Dict[str, Any]] = None  # a planned move (coordinator/moves.py): kind, boundary step, reason

    def report(self) -> Dict[str, Any]:
        d = asdict(self)
        detect = self.t_detect - self.t_fail
        ready = (self.t_ready or self.t_detect) - self.t_detect
        d.update(
            detect_s=round(detect, 4),
            reconfigure_s=round(max(ready - self.transfer_s, 0.0), 4),
            transfer_s=round(self.transfer_s, 4),
            resume_s=round((self.t_resumed - self.t_ready) if self.t_resumed and self.t_ready else 0.0, 4),
            downtime_s=round((self.t_resumed - self.t_fail) if self.t_resumed else 0.0, 4),
        )
        for k in ("t_fail", "t_detect", "t_ready", "t_resumed"):  # wall-clock anchors, for reports and charts
            d[k] = None if d[k] is None else round(d[k], 6)
        return d


class StepLog:
    """Rank 0's per-step figures in bounded memory, O(1) per step at any step count.

    The last ``window`` steps are kept (a step redone after a recovery replaces its own entry,
    so that it counts once); older steps are folded into running totals. The event log on disk
    keeps every step.
    """

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self._recent: "OrderedDict[int, tuple]" = OrderedDict()  # step -> (step_s, loss), oldest first (O(1) to drop, unlike a dict)
        self._recent_s = 0.0
        self._folded_s = 0.0
        self.last_step: Optional[int] = None
        self.last_loss: Optional[float] = None

    def add(self, step: int, loss: float, step_s: float) -> None:
        old = self._recent.pop(step, None)
        if old is not None:
            self._recent_s -= old[0]
        self._recent[step] = (step_s, loss)
        self._recent_s += step_s
        if self.last_step is None or step >= self.last_step:
            self.last_step, self.last_loss = step, loss
        while len(self._recent) > self.window:
            folded = self._recent.popitem(last=False)[1][0]
            self._folded_s += folded
            self._recent_s -= folded

    @property
    def productive_s(self) -> float:
        """Seconds spent in the steps that count (each step once)."""
        return self._folded_s + self._recent_s

    def steps_per_s(self, step: int, n: int = 10) -> float:
        """The pace over the ``n`` steps up to ``step`` (those still in the window)."""
        times = [self._recent[s][0] for s in range(max(step - n + 1, 1), step + 1) if s in self._recent]
        total = sum(times)
        return len(times) / total if times and total > 0 else 0.0

    def __len__(self) -> int:
        return len(self._recent)


class DelayHistogram:
    """Delays (seconds) in fixed 1 ms buckets up to 10 s, O(1) per sample and bounded memory:
    the heartbeat delay of every message at 10k ranks, with percentiles at any time."""

    BUCKETS = 10_000

    def __init__(self) -> None:
        self.counts = [0] * (self.BUCKETS + 1)
        self.n = 0
        self.max_s = 0.0

    def add(self, delay_s: float) -> None:
        i = int(delay_s * 1000.0)
        self.counts[0 if i < 0 else (i if i < self.BUCKETS else self.BUCKETS)] += 1
        self.n += 1
        if delay_s > self.max_s:
            self.max_s = delay_s

    def percentile_ms(self, q: float) -> Optional[float]:
        """The upper edge (ms) of the bucket holding the q-quantile (0 < q <= 1); None if empty."""
        if self.n == 0:
            return None
        need, seen = q * self.n, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= need:
                return float(i + 1)
        return float(self.BUCKETS + 1)

    def report(self) -> Dict[str, Any]:
        return {"count": self.n, "p50_ms": self.percentile_ms(0.5), "p99_ms": self.percentile_ms(0.99), "max_ms": round(1000 * self.max_s, 3)}


class Degraded:
    """When a job that shrank (``cluster.min_nodes``) trained with fewer processes than ranks:
    one span per shrink, from the step it shrank at to the step a grow-back made it whole."""

    def __init__(self) -> None:
        self.spans: List[Dict[str, Any]] = []

    def reformed(self, step: int, t: float, processes: int, world: int) -> None:
        """A generation of ``processes`` processes for ``world`` ranks starts at ``step``, time ``t``."""
        open_ = bool(self.spans) and self.spans[-1]["to_step"] is None
        if processes < world and not open_:
            self.spans.append({"from_step": step, "to_step": None, "processes": processes, "t_from": t, "t_to": None})
        elif processes < world:
            self.spans[-1]["processes"] = min(processes, self.spans[-1]["processes"])  # the fewest it came to
        elif open_:
            self.spans[-1].update(to_step=step, t_to=t)

    def report(self, now: float, last_step: int) -> Dict[str, Any]:
        """``{"seconds", "spans": [{"from_step", "to_step", "processes", "seconds"}]}``: a span still open ends now."""
        spans = [
            {
                "from_step": s["from_step"],
                "to_step": last_step if s["to_step"] is None else s["to_step"],
                "processes": s["processes"],
                "seconds": round((s["t_to"] or now) - s["t_from"], 3),
            }
            for s in self.spans
        ]
        return {"seconds": round(sum(s["seconds"] for s in spans), 3), "spans": spans}


def goodput(productive_s: float, wall_s: float) -> float:
    """Fraction of wall time (after start-up) spent in steps that count."""
    return 0.0 if wall_s <= 0 else min(1.0, productive_s / wall_s)


def tensorboard_missing() -> Optional[str]:
    """Why TensorBoard output cannot be written here, or None (no import: a cheap check)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return "the tensorboard package is not installed"
    return None
