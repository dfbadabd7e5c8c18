"""A realistic task: a small CNN with BatchNorm and dropout, trained from a map-style dataset
with augmentation, with its own LR scheduler; every feature of the training engine at once.

Run it (from the repository root, so that the worker processes can import ``examples.*``):

    python -m ckptless_hpc 'hydra.searchpath=[file://examples/conf]' task=vision_cnn \\
        train.grad_accum=4 train.clip_grad_norm=1.0 train.precision=bf16 train.data_workers=2 \\
        fault=kill_worker fault.rank=1 fault.step=20

What each part shows (docs/tasks.md):
- ``dataset()``: a map-style dataset (``__len__`` + ``__getitem__``); the framework maps
  (step, micro-batch, rank) to sample indices with a per-epoch permutation, so a replacement
  starts at the committed step without replaying the earlier ones, inside a DataLoader with
  ``train.data_workers`` processes. The images here are made from their index (a stand-in for
  decoding a file); the random flip and shift draw from torch's global RNG, which the framework
  seeds per (seed, step, rank, micro-batch) wherever the sample is decoded.
- BatchNorm: its running statistics are buffers; every rank takes rank 0's at each step (as
  torch DDP does), so every replica holds the same state and any survivor can serve it.
- Dropout: draws from torch's global RNG, seeded per micro-batch before the forward.
- ``build_scheduler``: a warm-up then cosine decay as a ``SequentialLR``; the framework steps
  it once per step and a replacement receives its state with the rest.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ckptless_hpc.tasks.base import Task, check_int

__all__ = ["ShapesDataset", "CNNTask"]


class ShapesDataset(Dataset):
    """``n`` 1x16x16 images of one of ``classes`` oriented stripes plus noise, label = the
    orientation; image ``i`` is a pure function of ``i`` (like reading record ``i`` of a file)."""

    def __init__(self, n: int = 4096, classes: int = 4, size: int = 16) -> None:
        self.n, self.classes, self.size = n, classes, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        label = int(torch.randint(0, self.classes, (), generator=g))
        angle = math.pi * label / self.classes
        yy, xx = torch.meshgrid(torch.arange(self.size, dtype=torch.float32), torch.arange(self.size, dtype=torch.float32), indexing="ij")
        img = torch.sin((xx * math.cos(angle) + yy * math.sin(angle)) * 1.3) + 0.5 * torch.randn(self.size, self.size, generator=g)
        # augmentation from torch's global RNG (seeded by the framework per micro-batch)
        if torch.rand(()) < 0.5:
            img = img.flip(0).flip(1)  # a 180-degree turn keeps the stripe orientation
        img = torch.roll(img, shifts=int(torch.randint(-2, 3, ())), dims=1)
        return img.unsqueeze(0), label


class _Net(nn.Module):
    def __init__(self, classes: int, width: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(self.drop(x.flatten(1)))


class CNNTask(Task):
    def __init__(self, batch_size: int = 16, width: int = 8, classes: int = 4, dropout: float = 0.1, samples: int = 4096, warmup_steps: int = 5) -> None:
        self.batch_size = check_int("batch_size", batch_size, hint="samples per micro-batch")
        self.width = check_int("width", width, hint="channels of the first convolution")
        self.classes = check_int("classes", classes, minimum=2, hint="a classifier needs 2 classes")
        self.samples = check_int("samples", samples, hint="size of the dataset")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, hint="steps of linear warm-up")
        self.dropout = float(dropout)

    def build_model(self) -> nn.Module:
        return _Net(self.classes, self.width, self.dropout)

    def dataset(self) -> Dataset:
        return ShapesDataset(self.samples, self.classes)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, optim, total_steps: int):
        warm = min(self.warmup_steps, max(1, total_steps - 1))
        return torch.optim.lr_scheduler.SequentialLR(
            optimizer,
            [
                torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warm),
                torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warm), eta_min=float(optim.lr) * 0.1),
            ],
            milestones=[warm],
        )

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        device = next(model.parameters()).device
        return F.cross_entropy(model(x.to(device)), y.to(device))
