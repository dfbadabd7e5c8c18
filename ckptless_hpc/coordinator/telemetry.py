"""What the coordinator shows and keeps of training as it goes: rank 0's steps (step_feed.py
decides what they mean), the task's metrics and evaluations, the console's progress line and
echo (progress.py), TensorBoard. Bookkeeping only: events are the shell's."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from ..metrics import StepLog
from ..rundir.tensorboard import TensorBoardSink
from ..progress import ConsoleEcho, Progress
from .step_feed import Resumed, StepFeed

log = logging.getLogger("ckptless_hpc.coordinator")


class Telemetry:
    def __init__(self, cfg: Any, world: int, census: Callable[[], Any], console_log: Callable[[], Optional[str]]) -> None:
        self.steps = StepLog()  # bounded: nothing here grows with the number of steps
        self.feed = StepFeed(self.steps, cfg.train.steps, world, census)
        self.progress = Progress(cfg.train.steps, cfg.train.log_every)
        self.console = ConsoleEcho(self.progress, console_log)
        self.tensorboard: Optional[TensorBoardSink] = None
        self.skipped: Dict[str, int] = {}  # steps dropped so far, by cause (rank 0's count)
        self.last_metrics: Optional[Dict[str, float]] = None  # the task's own metrics of the last step
        self.last_eval: Optional[Dict[str, Any]] = None  # {"step", "metrics"} of the last evaluation

    def open_tensorboard(self, folder: str, on_error: Callable[..., None]) -> None:
        self.tensorboard = TensorBoardSink(folder, on_error=on_error)

    def close_tensorboard(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def step(self, m: Any, now: float) -> Optional[Resumed]:
        """Rank 0's step: kept; a recovery's first step after it returns its ``Resumed``."""
        back = self.feed.on_step(m, now)
        self.skipped = m.skipped_total or self.skipped
        self.last_metrics = m.metrics or self.last_metrics
        if self.tensorboard is not None:
            self.tensorboard.step(m.step, m.loss, m.lr, m.grad_norm, m.step_s, m.samples / m.step_s if m.samples and m.step_s > 0 else None)
            self.tensorboard.scalars("train", m.step, m.metrics)
        return back

    def show(self, m: Any, now: float, t_train: Optional[float], recoveries: int, gen: int) -> None:
        self.progress.update(self.feed.snapshot(m, now, t_train, recoveries, gen))

    def eval(self, m: Any) -> None:
        """An evaluation (a recovered generation that starts at an evaluation step redoes it: same values)."""
        self.last_eval = {"step": m.step, "metrics": m.metrics}
        if self.tensorboard is not None:
            self.tensorboard.scalars("eval", m.step, m.metrics)
        self.progress.note(f"eval at step {m.step}: " + " ".join(f"{k} {v:.4f}" for k, v in sorted(m.metrics.items())))

    def resumed(self, step: int, report: Dict[str, Any]) -> None:
        if self.tensorboard is not None:
            self.tensorboard.recovery(step, report)
        planned = report.get("planned")
        log.info(
            ("moved (%s, planned at step %d): " % (planned["kind"], planned["step"]) if planned and not planned.get("called_off") else "re-formed: " if planned else "recovered: ")
            + "downtime %.2fs (detect %.2f, reconfigure %.2f, transfer %.2f, resume %.2f)",
            report["downtime_s"],
            report["detect_s"],
            report["reconfigure_s"],
            report["transfer_s"],
            report["resume_s"],
        )
