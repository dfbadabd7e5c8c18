"""Tasks that write, from inside a live job, each rank's full model as that rank sees it
(imported by worker processes via PYTHONPATH): the independent view that test_plain_pytorch.py
compares with the export of a sharded final state.

The view is taken in the task's ``evaluate`` (``train.eval_every=train.steps``: once, after the
last step), before its forward. There every mode holds the full last-step parameters without
the state path: ``ddp`` its replica; ``zero`` after the owners' broadcast that an evaluation
starts with (the next step's would do the same); ``fsdp``/``hsdp`` its DTensor shards, gathered
here with ``full_tensor()`` (a collective: every rank evaluates, in the same order, so every rank
calls it for every parameter). Nothing of the state machinery (collect, snapshot, shard files,
export) is used: the tensors are the model's own ``named_parameters()`` and ``named_buffers()``.
"""

from __future__ import annotations

import os
from typing import Any, Dict

import torch
from engine_tasks import BatchNormSGD, SGDGroupsMLP
from torch import nn
from torch.distributed.tensor import DTensor


def full_view(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as a full tensor of this rank's (DTensors gathered)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().clone()
    return out


class _WritesItsView:
    """``gather_dir``: where each rank writes ``rank<r>-pid<pid>-<n>.pt`` ({"rank", "tensors"})."""

    def __init__(self, gather_dir: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.gather_dir = gather_dir
        self._rank = -1
        self._written = 0

    def val_batch(self, index: int, rank: int, world: int, generator: torch.Generator) -> Any:
        self._rank = rank  # the rank this process evaluates as (the evaluation's own argument)
        return self.batch(index, 0, 1, generator)

    def evaluate(self, model: nn.Module, batch: Any) -> Dict[str, Any]:
        view = full_view(model)
        if self.gather_dir:
            path = os.path.join(self.gather_dir, f"rank{self._rank}-pid{os.getpid()}-{self._written}.pt")
            torch.save({"rank": self._rank, "tensors": view}, path + ".tmp")
            os.replace(path + ".tmp", path)
        self._written += 1
        x, y = (t.to(next(iter(view.values())).device) for t in batch)
        return {"loss": nn.functional.cross_entropy(model(x), y)}


class SGDGroupsGather(_WritesItsView, SGDGroupsMLP):
    pass


class BatchNormSGDGather(_WritesItsView, BatchNormSGD):
    pass
