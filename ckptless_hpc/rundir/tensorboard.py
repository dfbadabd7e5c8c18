"""The TensorBoard curves of a run (``RUN_DIR/tensorboard``, ``train.tensorboard=true``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from .record import write_failure


class TensorBoardSink:
    """Training curves and recoveries for TensorBoard (``train.tensorboard=true``): one writer in
    the coordinator, fed by rank 0's per-step metrics and by each finished recovery. Imports
    ``torch.utils.tensorboard`` (and so torch) only when asked for. A write that fails (its
    thread meets a full disk) stops the curves, never the job: ``on_error(path, message)`` once."""

    def __init__(self, logdir: str, on_error: Optional[Callable[[str, str], None]] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.logdir = logdir
        self.on_error = on_error
        self._w: Any = SummaryWriter(log_dir=logdir)

    def step(self, step: int, loss: float, lr: Optional[float], grad_norm: Optional[float], step_s: float, samples_per_s: Optional[float]) -> None:
        scalars = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "perf/step_s": step_s, "perf/samples_per_s": samples_per_s or None}
        self._add(step, {k: v for k, v in scalars.items() if v is not None})

    def scalars(self, prefix: str, step: int, values: Optional[Dict[str, float]]) -> None:
        """``<prefix>/<name>`` for each value: a task's own metrics (train/...) and evaluations (eval/...)."""
        for k, v in sorted((values or {}).items()):
            self._w.add_scalar(f"{prefix}/{k}", v, step)

    def recovery(self, step: int, report: Dict[str, Any]) -> None:
        self._add(step, {f"recovery/{k}": report[k] for k in ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s")})

    def _add(self, step: int, scalars: Dict[str, float]) -> None:
        if self._w is None:
            return
        try:
            for tag, value in scalars.items():
                self._w.add_scalar(tag, value, step)
        except Exception as e:  # noqa: BLE001 - the writer re-raises its thread's failure (an OSError, or torch's wrapping of one)
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        w, self._w = self._w, None
        try:
            w.close()
        except Exception:  # noqa: BLE001 - it failed already: what it still held is lost
            pass
        if self.on_error is not None:
            self.on_error(self.logdir, f"cannot write {self.logdir}: {write_failure(e, os.path.join(self.logdir, 'events'))}; the TensorBoard curves stop here")

    def close(self) -> None:
        if self._w is None:
            return
        try:
            self._w.close()
            self._w = None
        except Exception as e:  # noqa: BLE001
            self._fail(e)
