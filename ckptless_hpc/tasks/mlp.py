"""A tiny MLP classifier on synthetic, learnable data (for fast tests and demos)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ckptless_hpc.tasks.base import Task, check_int, derive_generator

__all__ = ["MLPTask"]

#: Seed of the fixed "teacher" map that labels the inputs: a constant, so every rank, run
#: and machine labels the same input the same way.
TEACHER_SEED = 0x7EAC4E2


class MLPTask(Task):
    """Classify Gaussian inputs by a fixed random linear "teacher" (argmax of ``x @ W``).

    ``layers`` hidden layers of width ``hidden`` with GELU; ``batch_size`` is the per-rank
    micro-batch. The inputs of (step, rank, world) come from the generator passed to
    :meth:`batch`; the labels are a deterministic function of the inputs.
    """

    def __init__(
        self,
        input_dim: int = 32,
        hidden: int = 64,
        layers: int = 2,
        classes: int = 10,
        batch_size: int = 16,
    ) -> None:
        hint = "the MLP task needs positive sizes; see conf/task/mlp.yaml for defaults."
        self.input_dim = check_int("input_dim", input_dim, hint=hint)
        self.hidden = check_int("hidden", hidden, hint=hint)
        self.layers = check_int("layers", layers, minimum=0, hint="0 gives a linear model.")
        self.classes = check_int("classes", classes, minimum=2, hint="a classifier needs at least 2 classes.")
        self.batch_size = check_int("batch_size", batch_size, hint="per-rank micro-batch size.")
        teacher_gen = torch.Generator().manual_seed(TEACHER_SEED)
        self._teacher = torch.randn(self.input_dim, self.classes, generator=teacher_gen)

    def build_model(self) -> torch.nn.Module:
        dims = [self.input_dim] + [self.hidden] * self.layers
        mods: list[torch.nn.Module] = []
        for d_in, d_out in zip(dims[:-1], dims[1:]):
            mods += [torch.nn.Linear(d_in, d_out), torch.nn.GELU()]
        mods.append(torch.nn.Linear(dims[-1], self.classes))
        return torch.nn.Sequential(*mods)

    def batch(self, step: int, rank: int, world: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [batch_size, input_dim] float32, labels [batch_size] int64)."""
        g = derive_generator(generator, step, rank, world)
        x = torch.randn(self.batch_size, self.input_dim, generator=g)
        y = (x @ self._teacher).argmax(dim=1)
        return x, y

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        device = next(model.parameters()).device
        return F.cross_entropy(model(x.to(device)), y.to(device))

    def num_parameters(self) -> int:
        """Parameter count of :meth:`build_model`, computed without building it."""
        dims = [self.input_dim] + [self.hidden] * self.layers + [self.classes]
        return sum(d_in * d_out + d_out for d_in, d_out in zip(dims[:-1], dims[1:]))

    def describe(self) -> str:
        return (
            f"MLPTask(input_dim={self.input_dim}, hidden={self.hidden}, layers={self.layers}, "
            f"classes={self.classes}, batch_size={self.batch_size}): "
            f"{self.num_parameters()} parameters"
        )
