"""Adapting an ordinary PyTorch training loop into a ckptless_hpc task.

Run it (from the repository root, so that the worker processes can import ``examples.*``):

    python -m ckptless_hpc '~task' +task._target_=examples.plain_loop.RegressionTask \\
        train.steps=100 optim.lr=0.05 fault=kill_worker fault.rank=1 fault.step=30

(``~task`` drops the default task's arguments; ``task._target_=...`` alone would pass them to
this class too: ``dry_run=true`` says so in a second.)

BEFORE: the loop you have. It owns everything: the model, the optimizer, the data order,
the LR schedule, the loop itself, and (if it can survive anything) a checkpoint file.

    torch.manual_seed(0)
    data = make_dataset()                                   # (x, y) tensors in memory
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loader = DataLoader(TensorDataset(*data), batch_size=32, shuffle=True)   # hidden RNG state
    step = 0
    for epoch in range(epochs):
        for x, y in loader:                                 # position = how far THIS process got
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 1000 == 0:
                torch.save({...}, "ckpt.pt")                # the only way to survive a failure

AFTER: the class below. You keep the four things that are yours; the framework runs the loop.

    model           -> build_model()        (built under the framework's seed: same on every worker)
    optimizer       -> build_optimizer()    (optional; the default is AdamW from the optim.* config)
    loader/shuffle  -> batch(step, rank, world, generator): a PURE function. The data position
                       is derived from the step, never carried: a replacement worker that joins
                       at step 4711 computes the same batch as the worker it replaces would have.
    loss            -> loss(model, batch)
    zero_grad/backward/allreduce/step -> the framework (fixed-order gradient reduction, bitwise
                       reproducible), and it re-seeds torch's global RNG every step.
    sched.step()    -> the framework sets each step's LR from optim.lr, optim.warmup_steps and
                       optim.min_lr_ratio (linear warm-up, cosine decay): a function of the step.
    torch.save      -> gone. State lives in the workers' memory and moves peer-to-peer.

What to watch for (the determinism contract, docs/tasks.md):
- no randomness from python's ``random``, numpy's global RNG, the clock or a DataLoader's
  workers; draw from ``generator`` (or torch's global RNG, re-seeded every step);
- no state that changes during training outside the model and optimizer (a step counter,
  a running mean): it is not rolled back when a step is abandoned. Derive it from ``step``.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ckptless_hpc.tasks.base import Task, check_int, mix_seed

__all__ = ["RegressionTask", "make_dataset"]


def make_dataset(n: int = 4096, dim: int = 8, seed: int = 1234) -> Tuple[torch.Tensor, torch.Tensor]:
    """A fixed in-memory dataset (stands in for yours): y = sin(x . w) + noise, same everywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g) / dim**0.5
    y = torch.sin(3 * x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


class RegressionTask(Task):
    """The loop above as a task: an MLP regressor on a fixed dataset, SGD with momentum.

    The data order reproduces "shuffle every epoch" without any hidden state: the global batch
    of step ``s`` covers samples ``[s * B, (s + 1) * B)`` of the epoch's permutation, where
    ``B = batch_size * world`` and the permutation is drawn from (data_seed, epoch) alone, so
    every rank agrees on it. Rank ``r`` takes its own slice of the global batch.
    """

    def __init__(self, n_samples: int = 4096, dim: int = 8, hidden: int = 64, batch_size: int = 32, momentum: float = 0.9, data_seed: int = 1234) -> None:
        hint = "see examples/plain_loop.py"
        self.dim = check_int("dim", dim, hint=hint)
        self.hidden = check_int("hidden", hidden, hint=hint)
        self.batch_size = check_int("batch_size", batch_size, hint=hint)
        self.n_samples = check_int("n_samples", n_samples, minimum=1, hint=hint)
        self.momentum = float(momentum)
        self.data_seed = int(data_seed)
        self.x, self.y = make_dataset(self.n_samples, self.dim, self.data_seed)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.dim, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def build_optimizer(self, model: nn.Module, optim: Any) -> torch.optim.Optimizer:
        # optim.lr is the peak LR; the framework overwrites group["lr"] every step from the schedule
        return torch.optim.SGD(model.parameters(), lr=float(optim.lr), momentum=self.momentum, weight_decay=float(optim.weight_decay))

    def batch(self, step: int, rank: int, world: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        global_bs = self.batch_size * world
        first = step * global_bs + rank * self.batch_size  # this rank's first sample, counted over all epochs
        idx = torch.tensor([self._sample(i) for i in range(first, first + self.batch_size)])
        return self.x[idx], self.y[idx]

    def _sample(self, i: int) -> int:
        """The i-th sample seen in training: position i % N of epoch i // N's permutation."""
        epoch, pos = divmod(i, self.n_samples)
        return int(self._permutation(epoch)[pos])

    def _permutation(self, epoch: int) -> torch.Tensor:
        cache = getattr(self, "_perm_cache", None)
        if cache is None or cache[0] != epoch:  # a cache of a pure function: safe to lose
            g = torch.Generator().manual_seed(mix_seed(self.data_seed, epoch))
            cache = (epoch, torch.randperm(self.n_samples, generator=g))
            self._perm_cache = cache
        return cache[1]

    def loss(self, model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    def describe(self) -> str:
        return f"RegressionTask(dim={self.dim}, hidden={self.hidden}, batch_size={self.batch_size}, n_samples={self.n_samples}): {super().describe()}"
