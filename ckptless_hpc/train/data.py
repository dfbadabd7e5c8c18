"""The step-indexed data source: micro-batch ``micro`` of global step ``step`` on rank ``rank``
is a pure function of (seed, step, micro, rank, world), so a replacement starts at the committed
step without replaying earlier ones, and a survivor re-seeks after a recovery.

Where batches come from (the task decides):
- ``task.batch(step, rank, world, generator, micro=0)``: the task builds the micro-batch itself.
  A task whose ``batch`` has the old signature ``(step, rank, world, generator)`` gets, for
  micro-batch ``m`` of ``K``, the batch of virtual rank ``rank * K + m`` in a world of
  ``world * K``: the global batch of a step is then the same as a job of ``world * K`` ranks
  without accumulation.
- ``task.dataset()``: a map-style dataset (``__len__`` and ``__getitem__``). Sample position
  ``p = ((step * K + micro) * world + rank) * batch_size + j`` of the run is item
  ``perm_e[p mod len]`` of epoch ``e = p // len``, with ``perm_e`` a permutation drawn from
  (seed, e); the samples go through ``task.collate`` (torch's ``default_collate``). A stream
  (an ``IterableDataset``, or anything without random access) is refused: it cannot seek.

``train.data_workers=N`` runs the source inside a torch ``DataLoader`` with N worker processes
(prefetch, parallel decoding and augmentation); ``0`` computes batches in the training thread.
Both give the same bytes: each batch's generator and torch's global RNG are seeded from
(seed, step, rank, micro) wherever it is computed.
"""

from __future__ import annotations

import inspect
import os
from functools import lru_cache
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ..tasks.base import mix_seed, seed_global, seed_step

Index = Tuple[int, int, int]  # (step, micro, rank)


def forward_seed(seed: int, step: int, rank: int, micro: int) -> None:
    """Seed torch's global RNG for the forward/backward of one micro-batch (dropout and the like),
    independently of where and how its batch was made."""
    seed_global(mix_seed(seed, step, rank) if micro == 0 else mix_seed(seed, step, rank, micro, 2))


def batch_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """Seed the global RNG for making micro-batch ``micro`` and return its generator (micro-batch
    0 is exactly the single-batch contract of ``seed_step``)."""
    if micro == 0:
        return seed_step(seed, step, rank)
    seed_global(mix_seed(seed, step, rank, micro, 3))
    return torch.Generator().manual_seed(mix_seed(seed, step, rank, micro, 1))


def _takes_micro(batch_fn: Any) -> bool:
    try:
        params = inspect.signature(batch_fn).parameters
    except (TypeError, ValueError):
        return False
    return "micro" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_seekable(dataset: Any, task: Any) -> None:
    """Refuse a data source that cannot start at an arbitrary step."""
    name = f"{type(task).__module__}.{type(task).__name__}.dataset()"
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"{name} returned a {type(dataset).__name__}, a source without random access: a replacement worker must start "
            "the data at the committed step without replaying the earlier ones, and a stream cannot seek. "
            "HINT: return a map-style torch.utils.data.Dataset (__len__ and __getitem__), e.g. over a memory-mapped "
            "token file (see docs/tasks.md), or build each batch in task.batch(step, rank, world, generator, micro)"
        )
    if len(dataset) < 1:
        raise ValueError(f"{name} returned an empty dataset. HINT: check the path or the split it reads")


class StepBatches(Dataset):
    """Map-style view of the source: item ``(step, micro, rank)`` is that micro-batch. Built once
    per worker process (before its rank is known, so spares can start their loader early)."""

    def __init__(self, task: Any, seed: int, world: int, micro_batches: int) -> None:
        self.task, self.seed, self.world, self.k = task, seed, world, micro_batches
        dataset = task.dataset() if callable(getattr(task, "dataset", None)) else None
        if dataset is not None:
            check_seekable(dataset, task)
            bs = getattr(task, "batch_size", None)
            if not isinstance(bs, int) or bs < 1:
                raise ValueError(f"{type(task).__name__} has a dataset() but no integer batch_size >= 1. HINT: set self.batch_size (samples per micro-batch)")
        self.dataset: Optional[Any] = dataset
        self.takes_micro = dataset is None and _takes_micro(task.batch)

    def __len__(self) -> int:  # never iterated by index range: the sampler yields the indices
        return 0

    def __getitem__(self, index: Index) -> Tuple[int, int, Any]:
        step, micro, rank = index
        return step, micro, self.batch(step, micro, rank)

    def batch(self, step: int, micro: int, rank: int) -> Any:
        if self.dataset is not None:
            batch_generator(self.seed, step, rank, micro)  # augmentation drawing from torch's RNG
            return self._from_dataset(step, micro, rank)
        if self.takes_micro:
            return self.task.batch(step, rank, self.world, batch_generator(self.seed, step, rank, micro), micro=micro)
        vrank, vworld = rank * self.k + micro, self.world * self.k
        return self.task.batch(step, vrank, vworld, seed_step(self.seed, step, vrank))

    def _from_dataset(self, step: int, micro: int, rank: int) -> Any:
        n, bs = len(self.dataset), self.task.batch_size
        first = ((step * self.k + micro) * self.world + rank) * bs
        items = []
        for p in range(first, first + bs):
            items.append(self.dataset[int(_permutation(self.seed, p // n, n)[p % n])])
        collate = getattr(self.task, "collate", None)
        return collate(items) if callable(collate) else torch.utils.data.default_collate(items)


@lru_cache(maxsize=2)
def _permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(seed, epoch, 0x5EED)))


class _Seekable(Sampler):
    """Yields (step, micro, rank) from a start position to the end of the run; re-pointed on seek."""

    def __init__(self, total_steps: int, micro_batches: int) -> None:
        self.total, self.k = total_steps, micro_batches
        self.start: Optional[int] = None  # None: nothing (the loader's workers start idle)
        self.rank = 0

    def __iter__(self) -> Iterator[Index]:
        if self.start is None:
            return iter(())
        return ((i // self.k, i % self.k, self.rank) for i in range(self.start, self.total * self.k))

    def __len__(self) -> int:
        return 0 if self.start is None else self.total * self.k - self.start


class Feed:
    """Micro-batches of one rank, in the training thread."""

    def __init__(self, batches: StepBatches) -> None:
        self.batches = batches
        self.rank = 0

    def bind(self, rank: int) -> None:
        self.rank = rank

    def get(self, step: int, micro: int) -> Any:
        return self.batches.batch(step, micro, self.rank)

    def get_for(self, step: int, micro: int, rank: int) -> Any:
        """A micro-batch of ``rank``: this feed's own, or, in a shrunk job, one of the ranks this
        process trains for a lost one (made in the training thread: only the own rank is prefetched)."""
        return self.get(step, micro) if rank == self.rank else self.batches.batch(step, micro, rank)

    def close(self) -> None:
        pass


class LoaderFeed(Feed):
    """Micro-batches of one rank from a ``DataLoader`` with worker processes, prefetched in
    order. The workers start when the loader is built (a hot spare's too, before it has a
    rank); asking for any other position than the next one re-seeks (after a recovery, or a
    replacement's first step), dropping what was prefetched."""

    def __init__(self, batches: StepBatches, total_steps: int, workers: int, prefetch: int, close_fds: Sequence[int] = ()) -> None:
        super().__init__(batches)
        self.sampler = _Seekable(total_steps, batches.k)
        fds: List[int] = list(close_fds)
        self.loader = DataLoader(
            batches,
            batch_size=None,
            sampler=self.sampler,
            num_workers=workers,
            prefetch_factor=prefetch,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(0),  # never draws from the global RNG
            worker_init_fn=lambda _wid: _close_inherited(fds),
            multiprocessing_context="fork",
        )
        self._it: Optional[Iterator[Any]] = iter(self.loader)  # starts the workers now, idle
        self._next: Optional[Tuple[int, int]] = None
        self.seeks = 0

    def bind(self, rank: int) -> None:
        if rank != self.sampler.rank:
            self.sampler.rank = rank
            self._next = None

    def get(self, step: int, micro: int) -> Any:
        if self._next != (step, micro):
            self.sampler.start = step * self.batches.k + micro
            self._it = iter(self.loader)
            self.seeks += 1
        s, m, batch = next(self._it)
        if (s, m) != (step, micro):
            raise RuntimeError(f"data loader returned micro-batch {m} of step {s}, expected {micro} of step {step}")
        self._next = (step, micro + 1) if micro + 1 < self.batches.k else (step + 1, 0)
        return batch

    def close(self) -> None:
        self._it = None


def _close_inherited(fds: Sequence[int]) -> None:
    """In a forked loader worker: close the parent's sockets (control channel, state server), so
    that the coordinator sees the connection close the moment the parent dies."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def make_feed(task: Any, seed: int, world: int, micro_batches: int, total_steps: int, workers: int, prefetch: int, close_fds: Sequence[int] = ()) -> Feed:
    batches = StepBatches(task, seed, world, micro_batches)
    if workers == 0:
        return Feed(batches)
    return LoaderFeed(batches, total_steps, workers, prefetch, close_fds)
