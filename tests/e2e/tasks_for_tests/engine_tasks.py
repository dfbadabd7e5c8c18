"""Tasks that exercise one feature of the training engine each (imported by worker processes
via PYTHONPATH)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import IterableDataset

from ckptless_hpc.tasks.mlp import MLPTask


class BatchNormMLP(MLPTask):
    """An MLP with BatchNorm (running statistics: buffers) and dropout."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(self.input_dim, self.hidden), nn.BatchNorm1d(self.hidden), nn.GELU(), nn.Dropout(0.2), nn.Linear(self.hidden, self.classes)
        )


class OneCycleMLP(MLPTask):
    """The user's own scheduler: OneCycleLR over the run."""

    def build_scheduler(self, optimizer, optim, total_steps):
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=float(optim.lr), total_steps=total_steps)


class MicroMLP(MLPTask):
    """The new batch signature: learns the micro-batch index."""

    def batch(self, step, rank, world, generator, micro=0):
        x, y = super().batch(step, rank, world, generator)
        return x + 0.01 * micro, y


class MixedDtypeMLP(MLPTask):
    """Parameters of two dtypes: the first layer in float64, the rest float32."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(_Cast(nn.Linear(self.input_dim, self.hidden).double()), nn.GELU(), nn.Linear(self.hidden, self.classes))


class _Cast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.double()).float()


class NanAtStepMLP(MLPTask):
    """The loss is NaN at the steps in ``nan_steps`` (on every rank, as a diverged model's is)."""

    def __init__(self, nan_steps=(7,), **kw) -> None:
        super().__init__(**kw)
        self.nan_steps = set(int(s) for s in nan_steps)

    def batch(self, step, rank, world, generator):
        x, y = super().batch(step, rank, world, generator)
        if step in self.nan_steps:
            x = x * float("nan")
        return x, y


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


class StreamTask(MLPTask):
    """A data source that cannot seek (an IterableDataset): must be refused."""

    def dataset(self):
        return _Stream()


class SyncBNTask(MLPTask):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.input_dim, self.hidden), nn.SyncBatchNorm(self.hidden), nn.Linear(self.hidden, self.classes))


class ShardedRichMLP(MLPTask):
    """Every kind of state a sharded run must carry: BatchNorm running statistics (buffers),
    dropout (RNG), the user's own scheduler (OneCycleLR state), AdamW moments, several layers
    (several shards / FSDP units)."""

    def build_model(self) -> nn.Module:
        h = self.hidden
        return nn.Sequential(
            nn.Linear(self.input_dim, h), nn.BatchNorm1d(h), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, self.classes),
        )

    def build_scheduler(self, optimizer, optim, total_steps):
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=float(optim.lr), total_steps=total_steps)

    def loss(self, model, batch):  # a metric of its own, reduced with the loss (FSDP's path too)
        x, y = (t.to(next(model.parameters()).device) for t in batch)
        logits = model(x)
        return nn.functional.cross_entropy(logits, y), {"accuracy": (logits.argmax(dim=1) == y).float().mean()}

    def val_batch(self, index, rank, world, generator):
        return self.batch(index, 0, 1, generator)

    def evaluate(self, model, batch):  # with train.eval_every: the sharded model, in eval mode
        x, y = (t.to(next(model.parameters()).device) for t in batch)
        logits = model(x)
        return {"loss": nn.functional.cross_entropy(logits, y), "accuracy": (logits.argmax(dim=1) == y).float().mean()}


class NeverBuilt(MLPTask):
    """Fails if constructed: the dry run must check the task without building it."""

    def __init__(self, width: int, **kw) -> None:
        raise RuntimeError("NeverBuilt was constructed")

class SGDGroupsMLP(MLPTask):
    """SGD with momentum and two param groups (weights with weight decay, biases at half the LR
    without), and the user's own LambdaLR: plain SGD makes the gradient's scale visible in the
    weights (Adam would hide a wrong divisor)."""

    def build_optimizer(self, model, optim):
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return torch.optim.SGD(
            [{"params": weights, "weight_decay": 1e-2}, {"params": biases, "lr": float(optim.lr) * 0.5, "weight_decay": 0.0}],
            lr=float(optim.lr), momentum=0.9,
        )

    def build_scheduler(self, optimizer, optim, total_steps):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))


class BatchNormSGD(SGDGroupsMLP):
    """BatchNorm (buffers: rank 0's statistics are everyone's) and dropout, trained with SGD."""

    def build_model(self) -> nn.Module:
        return BatchNormMLP.build_model(self)
