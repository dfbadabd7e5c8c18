"""A model with integer and bool buffers that its forward changes (tests/models/__init__.py)."""

from __future__ import annotations

import torch
from torch import nn

from ckptless_hpc.tasks.mlp import MLPTask


class Counting(nn.Module):
    def __init__(self, d_in: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, classes))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))
        self.register_buffer("histogram", torch.zeros(4, dtype=torch.int32))
        self.register_buffer("saw_large", torch.zeros(d_in, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.forwards += 1
                self.histogram += torch.bincount((x[:, 0].abs() * 2).clamp(max=3).long(), minlength=4).to(torch.int32)
                self.saw_large |= (x.abs() > 2.5).any(0)
        return self.body(x)


class CountersTask(MLPTask):
    def build_model(self) -> nn.Module:
        return Counting(self.input_dim, self.hidden, self.classes)
