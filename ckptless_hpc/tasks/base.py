"""The task interface, plus the pure helpers every task shares (seed mixing, LR schedule).

Contract (see DESIGN.md, "What state is"): a task's batches are pure functions of
(seed, step, rank, world). A task draws randomness only from the generator it is handed
(or from torch's global RNG, which the framework re-seeds every step), never from the
clock or python's ``random``. That is what lets a replacement worker rebuild its data
position instead of receiving it, and keeps faulty runs bitwise equal to fault-free ones.
"""

from __future__ import annotations

import hashlib
import functools
import math
import operator
from typing import Any

import torch

__all__ = [
    "Task",
    "lr_at",
    "mix_seed",
    "seed_global",
    "derive_generator",
    "num_parameters",
    "check_int",
    "format_count",
]

_MASK63 = (1 << 63) - 1


def mix_seed(*ints: int) -> int:
    """A stable 63-bit hash of integers: same inputs -> same seed, on every machine and run.

    Uses blake2b (never python's ``hash()``, which is salted per process for str/bytes and
    not a mixing function for ints). Order matters: ``mix_seed(1, 2) != mix_seed(2, 1)``.
    """
    text = ",".join(str(operator.index(i)) for i in ints)
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8, person=b"ckptless_seed").digest()
    return int.from_bytes(digest, "little") & _MASK63


def derive_generator(generator: torch.Generator, *ints: int) -> torch.Generator:
    """A fresh CPU generator seeded from one draw of ``generator`` mixed with ``ints``.

    Tasks call ``derive_generator(generator, step, rank, world)`` so their batches differ
    per (step, rank, world) even if the caller reused one seed, while staying a pure
    function of the generator's state and those integers.
    """
    draw = int(torch.randint(0, _MASK63, (1,), generator=generator).item())
    return torch.Generator().manual_seed(mix_seed(draw, *ints))


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based): a pure function of its arguments.

    Linear warmup ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (so the
    first step already moves and step ``warmup_steps - 1`` reaches ``lr``), then cosine
    decay from ``lr`` down to ``lr * min_lr_ratio`` at ``total_steps``; constant after.
    """
    if step < 0:
        raise ValueError(f"step={step} must be >= 0. HINT: steps are counted from 0.")
    if warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={warmup_steps} must be >= 0. HINT: use 0 for no warmup.")
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps} must be > 0. HINT: set the run's total step count.")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio={min_lr_ratio} must be in [0, 1]. HINT: 0.1 decays to a tenth of optim.lr; 1.0 keeps the LR constant.")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    min_lr = lr * min_lr_ratio
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@functools.lru_cache(maxsize=None)
def _accelerators() -> bool:
    """Whether torch.manual_seed has more than the CPU generator to seed here: an accelerator
    torch can use (CUDA, XPU, MPS, MTIA) or a registered custom device module. Asked once per
    process (a seed is set several times a step)."""
    custom = getattr(torch, torch._C._get_privateuse1_backend_name(), None)
    return torch.cuda.is_available() or torch.xpu.is_available() or torch.backends.mps.is_available() or torch.mtia.is_available() or custom is not None


def seed_global(seed: int) -> None:
    """``torch.manual_seed(seed)``, without its cost on a machine with no accelerator: there
    torch queues the seeding of each accelerator it may initialise later (CUDA, XPU, MTIA) with
    a formatted traceback of the caller's stack (``torch.cuda._lazy_call``), about 0.4 ms a
    call at a worker's stack depth, several calls a step. The CPU generator's state is the same
    either way; with an accelerator torch's own call runs (it seeds an initialised one at once)."""
    if _accelerators():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


def seed_step(seed: int, step: int, rank: int) -> torch.Generator:
    """Seed torch's global RNG for (seed, step, rank) (dropout and the like) and return the
    generator a task draws the batch of that step and rank from: the whole per-step
    determinism contract, shared by the worker and the benchmark baselines."""
    seed_global(mix_seed(seed, step, rank))
    return torch.Generator().manual_seed(mix_seed(seed, step, rank, 1))


def set_lr(optimizer: torch.optim.Optimizer, optim: Any, step: int, total_steps: int) -> float:
    """Set every param group's LR to ``lr_at(step)`` for ``optim`` (an OptimConfig); returns it."""
    lr = lr_at(step, lr=optim.lr, warmup_steps=optim.warmup_steps, total_steps=total_steps, min_lr_ratio=optim.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def num_parameters(model: torch.nn.Module) -> int:
    """Number of parameter elements of ``model`` (tied parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


class Task:
    """A training task: the model, its optimizer, and the data as pure functions of
    (step, rank, world).

    Subclass it and point a Hydra task config's ``_target_`` at the subclass; Hydra calls
    the constructor with the keyword arguments of that config group.
    """

    def build_model(self) -> torch.nn.Module:
        """Build the model. Must be deterministic given ``torch.manual_seed`` (the framework
        seeds the global RNG before calling)."""
        raise NotImplementedError

    def build_optimizer(self, model: torch.nn.Module, optim: Any) -> torch.optim.Optimizer:
        """The optimizer; ``optim`` has attributes lr, beta1, beta2, eps, weight_decay."""
        return torch.optim.AdamW(
            model.parameters(),
            lr=float(optim.lr),
            betas=(float(optim.beta1), float(optim.beta2)),
            eps=float(optim.eps),
            weight_decay=float(optim.weight_decay),
        )

    def batch(self, step: int, rank: int, world: int, generator: torch.Generator) -> Any:
        """This rank's micro-batch of global step ``step``; depends only on the arguments."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Scalar loss of ``model`` on ``batch``."""
        raise NotImplementedError

    # Optional, not defined here (the framework looks for them):
    #   val_dataset() -> a map-style dataset, or val_batch(index, rank, world, generator) -> a batch,
    #   and evaluate(model, batch) -> {"name": scalar tensor or float}: train.eval_every=N runs them
    #   (docs/tasks.md, "Evaluation"). loss() may also return (loss, {"name": ...}): metrics of the step.

    def on_step_end(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Called on every rank after each optimizer step that was committed (``step``: its index,
        from 0; not after a step skipped for a non-finite loss or a grad-scaler overflow). What it
        keeps must live in :meth:`state_dict` (and come back through :meth:`load_state_dict`):
        then it is carried to replacements, hashed and saved with the rest of the state. Runs under ``torch.no_grad()``."""

    def state_dict(self) -> dict:
        """Optional extra state (tensors) to replicate alongside the model and optimizer."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def describe(self) -> str:
        """One line: task name and parameter count."""
        return f"{type(self).__name__}: {format_count(self._count_parameters())} parameters"

    def _count_parameters(self) -> int:
        """Count parameters without allocating them or touching the global RNG."""
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return num_parameters(self.build_model())


def format_count(n: int) -> str:
    """Human-readable parameter count: 431,616 -> '431.6K (431616)'."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit} ({n})"
    return str(n)


def check_int(field: str, value: Any, *, minimum: int = 1, hint: str) -> int:
    """Validate an integer task argument; ValueError names the field, the value and a hint."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"task.{field}={value!r} must be an integer >= {minimum}. HINT: {hint}")
    return value
