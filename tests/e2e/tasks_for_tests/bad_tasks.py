"""Tasks that break the contract on purpose (imported by worker processes via PYTHONPATH)."""

from __future__ import annotations

import torch

from ckptless_hpc.tasks.mlp import MLPTask


class GlobalRNGTask(MLPTask):
    """Draws its inputs from torch's global RNG instead of the generator it is given."""

    def batch(self, step, rank, world, generator):
        x = torch.randn(self.batch_size, self.input_dim)
        return x, torch.zeros(self.batch_size, dtype=torch.long)


class RaisesAtStep(MLPTask):
    """A bug of the task's own: its hook raises after step 3's update, on every rank."""

    def on_step_end(self, model, optimizer, step):
        if step == 3:
            raise RuntimeError("the task's own bug at step 3")


class StallsAtStep(MLPTask):
    """Rank 1's batch of step 3 never comes (a data source that hangs: its heartbeats go on)."""

    def batch(self, step, rank, world, generator):
        if step == 3 and rank == 1:
            import time

            time.sleep(3600)
        return super().batch(step, rank, world, generator)
