"""A task whose forward waits before it computes (imported by worker processes via PYTHONPATH).

Each micro-batch's loss first waits ``wait_s`` (an event that sleeps: no CPU, as a wait on a
peer's gather or on an input pipeline costs none), then spends ``burn_s`` seconds of the
training thread's CPU, then runs the MLP. A step is thus mostly wait, inside the span an
injected straggler (``fault=slow``) stretches: the wait must not be stretched, the CPU must."""

from __future__ import annotations

import threading
import time

import torch

from ckptless_hpc.tasks.mlp import MLPTask


class WaitingMLP(MLPTask):
    def __init__(self, wait_s: float = 0.4, burn_s: float = 0.03, **kw) -> None:
        super().__init__(**kw)
        self.wait_s, self.burn_s = float(wait_s), float(burn_s)

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        threading.Event().wait(self.wait_s)
        t = time.thread_time()
        while time.thread_time() - t < self.burn_s:  # the CPU part, the same on a loaded machine (its wall time is not)
            pass
        return super().loss(model, batch)
