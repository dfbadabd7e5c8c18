"""Live progress of a job: a tqdm bar on a terminal, plain periodic log lines otherwise.

Shown by the coordinator: in the terminal that launched a local run, in the coordinator's log
(and the job's output file) on Slurm, where lines keep the log readable.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger("ckptless_hpc.progress")


@dataclass
class Snapshot:
    step: int
    total: int
    loss: float
    samples_per_s: Optional[float]
    steps_per_s: float
    alive: int
    world: int
    spares: int
    recoveries: int
    goodput: float
    gen: int

    def line(self) -> str:
        rate = f"{self.samples_per_s:.0f} samples/s" if self.samples_per_s else f"{self.steps_per_s:.1f} steps/s"
        return (
            f"step {self.step}/{self.total} loss {self.loss:.4f} | {rate} | workers {self.alive}/{self.world} "
            f"spares {self.spares} | recoveries {self.recoveries} | goodput {100 * self.goodput:.1f}% | gen {self.gen}"
        )


class Progress:
    def __init__(self, total: int, log_every: int, tty: Optional[bool] = None) -> None:
        self.total = total
        self.log_every = log_every
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)

    def update(self, snap: Snapshot) -> None:
        if self._bar is not None:
            self._bar.n = snap.step
            self._bar.set_postfix_str(snap.line().split(" | ", 1)[1] + f" | loss {snap.loss:.3f}", refresh=True)
        elif snap.step % self.log_every == 0 or snap.step == self.total:
            log.info(snap.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
