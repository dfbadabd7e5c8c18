"""A task's own metrics and its evaluation: the pure parts the engine uses.

Metrics of the step: ``task.loss`` may return ``(loss, {"name": tensor_or_float, ...})``; each
metric is summed over micro-batches and ranks in the loss's own all-reduce (one float64 vector)
and divided by ``world * K``, as the loss is.

Evaluation (``train.eval_every=N``, ``train.eval_batches=M``): batch ``i`` of ``0..M-1`` is
``task.val_batch(i, rank, world, generator)`` with the generator seeded from (seed, i), or items
``i * bs .. (i + 1) * bs - 1`` (wrapping) of ``task.val_dataset()``. Rank ``r`` evaluates batches
``r, r + world, ...``; every rank runs the same number of forwards (``ceil(M / world)``; one past
``M`` is a repeat that counts for nothing), so a sharded model's collectives line up. Each
metric is the mean over the M batches, from one float64 all-reduce.

Names are checked: the same set on every micro-batch and step (here), and on every rank (a
name hash in the reduced vector: its sum must be ``world`` times this rank's).
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..tasks.base import mix_seed, seed_global

EVAL_SALT = 0xE7A1


def name_hash(names: Sequence[str]) -> int:
    """A 32-bit hash of the sorted names: summed over up to 2**20 ranks, still exact in float64."""
    return zlib.crc32("\0".join(names).encode())


def split_loss(out: Any, task: Any) -> Tuple[torch.Tensor, Optional[Mapping[str, Any]]]:
    """``task.loss``'s result as (loss, metrics or None)."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise ValueError(
                f"{type(task).__name__}.loss returned a tuple of {len(out)} ({', '.join(type(o).__name__ for o in out)}). "
                'HINT: return the loss tensor, or (loss, {"name": tensor_or_float, ...})'
            )
        return out[0], out[1]
    return out, None


class MetricSums:
    """Float64 sums of named scalars, with the set of names fixed by the first ``add``."""

    def __init__(self, what: str) -> None:
        self.what = what  # "TaskName.loss" / "TaskName.evaluate": for the errors
        self.names: Optional[List[str]] = None
        self.sums: Optional[torch.Tensor] = None

    def add(self, metrics: Mapping[str, Any], device: torch.device, weight: float = 1.0) -> None:
        names = sorted(str(k) for k in metrics)
        if self.names is None:
            self.names = names
        elif names != self.names:
            raise ValueError(f"{self.what} returned the metrics {names}, earlier {self.names}. HINT: return the same names every time (on every rank, micro-batch and step)")
        if not names:
            return
        vals = []
        for k in names:
            v = metrics[k]
            v = v.detach().to(device=device, dtype=torch.float64) if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64, device=device)
            if v.numel() != 1:
                raise ValueError(f"{self.what}: metric {k!r} has {v.numel()} elements. HINT: return a scalar (e.g. .mean())")
            vals.append(v.reshape(1))
        vec = torch.cat(vals) * weight if weight else torch.zeros(len(vals), dtype=torch.float64, device=device)  # 0 * nan is nan
        self.sums = vec if self.sums is None else self.sums + vec

    def zero(self) -> None:
        if self.sums is not None:
            self.sums.zero_()

    def vector(self, head: torch.Tensor) -> torch.Tensor:
        """``head`` (e.g. the loss sum), the sums and the names' hash: what the all-reduce sums."""
        if not self.names:
            return head
        h = torch.tensor([float(name_hash(self.names))], dtype=torch.float64, device=head.device)
        return torch.cat([head.reshape(-1), self.sums, h])

    def means(self, reduced: torch.Tensor, world: int, n: int, skip: int = 1) -> Dict[str, float]:
        """The reduced vector's metrics divided by ``n`` (past the ``skip`` head values)."""
        if not self.names:
            return {}
        got, want = float(reduced[-1]), float(world * name_hash(self.names))
        if got != want:
            raise ValueError(f"{self.what} returned different metric names on different ranks (this rank: {self.names}). HINT: return the same names on every rank")
        vals = (reduced[skip:-1] / n).tolist()
        return dict(zip(self.names, vals))


class ValSource:
    """The task's validation batches by index (pure functions of (seed, index))."""

    def __init__(self, task: Any, seed: int) -> None:
        self.task, self.seed = task, seed
        self.dataset = task.val_dataset() if callable(getattr(task, "val_dataset", None)) else None
        name = type(task).__name__
        if self.dataset is None and not callable(getattr(task, "val_batch", None)):
            raise ValueError(
                f"train.eval_every is set but {name} has neither val_dataset() nor val_batch(index, rank, world, generator). "
                'HINT: define one of them (docs/tasks.md, "Evaluation"), or set train.eval_every=0'
            )
        if not callable(getattr(task, "evaluate", None)):
            raise ValueError(f'train.eval_every is set but {name} has no evaluate(model, batch). HINT: return a dict of scalar metrics, e.g. {{"loss": ...}}')
        if self.dataset is not None:
            from .data import check_seekable

            check_seekable(self.dataset, task)
            self.batch_size = getattr(task, "val_batch_size", None) or getattr(task, "batch_size", None)
            if not isinstance(self.batch_size, int) or self.batch_size < 1:
                raise ValueError(f"{name} has a val_dataset() but no integer val_batch_size or batch_size >= 1. HINT: set self.val_batch_size")

    def batch(self, index: int, rank: int, world: int) -> Any:
        gen = torch.Generator().manual_seed(mix_seed(self.seed, index, EVAL_SALT))
        seed_global(mix_seed(self.seed, index, EVAL_SALT, 1))  # whatever draws from the global RNG
        if self.dataset is None:
            return self.task.val_batch(index, rank, world, gen)
        n, bs = len(self.dataset), self.batch_size
        items = [self.dataset[(index * bs + j) % n] for j in range(bs)]
        collate = getattr(self.task, "collate", None)
        return collate(items) if callable(collate) else torch.utils.data.default_collate(items)


def eval_indices(rank: int, world: int, batches: int) -> List[Tuple[int, float]]:
    """(batch index, weight) of this rank: ``ceil(batches / world)`` of them on every rank, the
    ones past ``batches`` repeats of a real batch with weight 0."""
    per_rank = -(-batches // world)
    out = []
    for i in range(per_rank):
        index = rank + i * world
        out.append((index, 1.0) if index < batches else (index % batches, 0.0))
    return out


def eval_due(step: int, every: int, total: int) -> bool:
    """Is there an evaluation after ``step`` committed steps: every ``every`` steps and at the end."""
    return every > 0 and step > 0 and (step % every == 0 or step == total)
