"""A gradient reduction whose result does not depend on how many processes compute it
(``train.reduction=fixed``; the elastic mode, ``cluster.min_nodes``).

A job of ``W`` ranks has ``W`` **virtual ranks** for life, each with its ``K`` micro-batches (data
and RNG are functions of the virtual rank, :mod:`.data`). A process holds one or more of them: its
own, and after a shrink the virtual ranks of lost processes too. The gradient of virtual rank
``v`` is the left fold of its micro-batches' gradients (autograd's accumulation, on one process
whatever the layout); the sum over the virtual ranks follows one fixed binary tree over
``0..W-1`` (split at the largest power of two below the width), every internal node
``left + right``. Float addition is commutative but not associative: the tree fixes the
association, and who computes a node does not change its bits.

One reduction (shared/ELASTIC.md):

1. each process sums the maximal subtrees whose virtual ranks it holds (:func:`cover`), left to
   right;
2. all-to-all: chunk ``c`` of every partial sum goes to process ``c`` (equal chunks, the last one
   padded: gloo's all-gather wants equal sizes);
3. process ``c`` combines the partials of its chunk in tree order (:func:`combine`);
4. all-gather of the chunks.

The bytes are those of a ring all-reduce. The result is bitwise the tree sum computed in one
process, for every assignment of the virtual ranks to processes (tests/unit/test_fixed_reduce.py).
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

Range = Tuple[int, int]  # the virtual ranks [lo, hi): a subtree of the fixed tree


def split(lo: int, hi: int) -> int:
    """Where the tree over ``[lo, hi)`` (two or more leaves) splits: after the largest power of
    two below its width."""
    k = 1
    while k * 2 < hi - lo:
        k *= 2
    return lo + k


def cover(lo: int, hi: int, held: FrozenSet[int]) -> List[Range]:
    """The maximal subtrees of the tree over ``[lo, hi)`` whose leaves are all in ``held``, left
    to right: O(|held| log width), subtrees holding none of them are never entered."""
    return _cover(lo, hi, sorted(held))


def _cover(lo: int, hi: int, held: List[int]) -> List[Range]:
    n = bisect.bisect_left(held, hi) - bisect.bisect_left(held, lo)  # held leaves in [lo, hi)
    if n == hi - lo:
        return [(lo, hi)]
    if n == 0:
        return []
    mid = split(lo, hi)
    return _cover(lo, mid, held) + _cover(mid, hi, held)


def tree_sum(lo: int, hi: int, leaf: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The sum over the subtree ``[lo, hi)``: a single leaf is returned as it is (no copy), an
    internal node is a new tensor ``left + right``."""
    if hi - lo == 1:
        return leaf(lo)
    mid = split(lo, hi)
    return tree_sum(lo, mid, leaf) + tree_sum(mid, hi, leaf)


def combine(lo: int, hi: int, partials: Dict[Range, torch.Tensor]) -> torch.Tensor:
    """The sum over ``[lo, hi)`` from already summed subtrees (which cover it)."""
    if (lo, hi) in partials:
        return partials[(lo, hi)]
    if hi - lo == 1:
        raise KeyError(f"virtual rank {lo} is held by no process")
    mid = split(lo, hi)
    return combine(lo, mid, partials) + combine(mid, hi, partials)


def holders_of(world: int, assignment: Optional[Sequence[Sequence[int]]]) -> Tuple[Tuple[int, ...], ...]:
    """The virtual ranks each process holds (``None``: process ``r`` holds virtual rank ``r``),
    checked: every virtual rank ``0..world-1`` exactly once."""
    if assignment is None:
        return tuple((r,) for r in range(world))
    held = tuple(tuple(int(v) for v in vs) for vs in assignment)
    flat = sorted(v for vs in held for v in vs)
    if flat != list(range(world)) or any(not vs for vs in held):
        raise ValueError(f"virtual ranks {[list(vs) for vs in held]} do not hold each of 0..{world - 1} exactly once, each process at least one")
    return held


class FixedReduce:
    """One generation's plan: process ``p`` holds ``holders[p]`` of the virtual ranks ``0..world-1``."""

    def __init__(self, world: int, holders: Sequence[Sequence[int]], rank: int) -> None:
        self.world = world
        self.holders = holders_of(world, holders)
        self.covers = [cover(0, world, frozenset(vs)) for vs in self.holders]
        self.mine = self.covers[rank]
        self.root = next(p for p, vs in enumerate(self.holders) if 0 in vs)  # who holds virtual rank 0

    def partials(self, leaves: Dict[int, Sequence[torch.Tensor]]) -> List[List[torch.Tensor]]:
        """Per tensor, this process's partial sums (one per subtree of :attr:`mine`); ``leaves``
        maps each held virtual rank to its tensors (used as they are where a subtree is one leaf)."""
        n = len(next(iter(leaves.values())))
        return [[tree_sum(lo, hi, lambda v, i=i: leaves[v][i]) for lo, hi in self.mine] for i in range(n)]

    def reduce(self, comm: Any, partials: List[List[torch.Tensor]], wait: Callable[[List[Any]], None]) -> List[torch.Tensor]:
        """The tree sums over all virtual ranks of each tensor, identical on every process
        (flat, of the partials' dtype); ``wait`` waits on the collectives' futures."""
        exchanges = [self.start(comm, parts) for parts in partials]
        wait([x.future for x in exchanges])
        wait([self.gather(comm, x) for x in exchanges])
        return [x.out for x in exchanges]

    def start(self, comm: Any, parts: Sequence[torch.Tensor]) -> "Exchange":
        """Launch one tensor's all-to-all: chunk ``p`` of each of this process's partial sums
        (``parts``, one per subtree of :attr:`mine`) to process ``p``. The sum is elementwise: a
        tensor cut in pieces (buckets) reduces to the same bits piece by piece."""
        size, n = comm.world, parts[0].numel()
        chunk = -(-n // size)
        send = torch.zeros(size, len(self.mine), chunk, dtype=parts[0].dtype, device=parts[0].device)
        for j, part in enumerate(parts):
            send[:, j] = torch.nn.functional.pad(part.reshape(-1), (0, size * chunk - n)).view(size, chunk)
        counts = [len(c) for c in self.covers]
        recv = torch.empty(sum(counts) * chunk, dtype=send.dtype, device=send.device)
        future = comm.alltoall(recv, send.view(-1), [c * chunk for c in counts], [len(self.mine) * chunk] * size)
        return Exchange(send, recv, n, chunk, future)

    def gather(self, comm: Any, x: "Exchange") -> Any:
        """After the all-to-all: this process's chunk combined in tree order, and the all-gather
        of every chunk into ``x.out`` launched (its future)."""
        inbox, off = {}, 0
        for cov in self.covers:
            for rng in cov:
                inbox[rng] = x.recv[off : off + x.chunk]
                off += x.chunk
        mine = combine(0, self.world, inbox)
        out = torch.empty(comm.world * x.chunk, dtype=x.recv.dtype, device=x.recv.device)
        x.out = out[: x.n]
        return comm.allgather(list(out.view(comm.world, x.chunk)), mine.contiguous())


class Exchange:
    """One tensor's reduction in flight: its buffers (kept alive while the collectives run), the
    all-to-all's future, then the result (``out``, once :meth:`FixedReduce.gather`'s all-gather
    has landed)."""

    def __init__(self, send: torch.Tensor, recv: torch.Tensor, n: int, chunk: int, future: Any) -> None:
        self.send, self.recv, self.n, self.chunk, self.future = send, recv, n, chunk, future
        self.out: Optional[torch.Tensor] = None
