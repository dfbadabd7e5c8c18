"""A short self-check of the determinism contract, run by every worker at start-up.

``task.batch(step, rank, world, generator)`` must be a pure function of its arguments: the
framework replays it after a failure and on replacements, and bitwise recovery depends on it.
Two calls with the same arguments, made under different states of torch's global RNG and
Python's ``random``, must return the same batch.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def check_batch_determinism(task: Any, world: int, seed: int = 12345) -> None:
    """Raise ValueError naming the task if its batches depend on anything but the arguments."""

    def draw(disturb: int) -> Any:
        torch.manual_seed(disturb)
        random.seed(disturb)
        return task.batch(1, 0, world, torch.Generator().manual_seed(seed))

    rng_state, py_state = torch.get_rng_state(), random.getstate()
    try:
        first, second = draw(1), draw(2)
    finally:
        torch.set_rng_state(rng_state)
        random.setstate(py_state)
    if not same(first, second):
        raise ValueError(
            f"{type(task).__module__}.{type(task).__name__}.batch(step, rank, world, generator) breaks the determinism "
            "contract: two calls with the same arguments returned different batches (it draws from torch's global RNG, "
            "Python's random, the clock or some state of its own). HINT: draw every random number from the `generator` "
            "argument, e.g. torch.randint(..., generator=generator); see docs/tasks.md"
        )
