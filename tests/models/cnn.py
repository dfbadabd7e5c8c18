"""A BatchNorm CNN with a residual block, as torchvision writes its ResNets (tests/models/__init__.py)."""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from ckptless_hpc.tasks.base import Task, derive_generator


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNetTiny(nn.Module):
    def __init__(self, classes: int = 5, c: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(F.relu(self.bn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class CNNTask(Task):
    def __init__(self, classes: int = 5, batch_size: int = 6) -> None:
        self.classes, self.batch_size = classes, batch_size
        self._teacher = torch.randn(3, classes, generator=torch.Generator().manual_seed(7))

    def build_model(self) -> nn.Module:
        return ResNetTiny(self.classes)

    def shard_units(self, model: nn.Module) -> List[nn.Module]:
        return list(model.layer1)

    def batch(self, step: int, rank: int, world: int, generator: torch.Generator) -> tuple:
        g = derive_generator(generator, step, rank, world)
        x = torch.randn(self.batch_size, 3, 8, 8, generator=g)
        return x, (x.mean((2, 3)) @ self._teacher).argmax(1)

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        device = next(model.parameters()).device
        return F.cross_entropy(model(x.to(device)), y.to(device))
