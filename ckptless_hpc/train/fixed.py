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
    """The maximal subtrees of the tree over ``[lo, hi)`` whose leaves are all in ``held``, left to right."""
    if all(v in held for v in range(lo, hi)):
        return [(lo, hi)]
    if hi - lo == 1:
        return []
    mid = split(lo, hi)
    return cover(lo, mid, held) + cover(mid, hi, held)


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
        self.rank = rank
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
        size = comm.world
        in_counts = [len(c) for c in self.covers]
        sent, received, futures = [], [], []
        for parts in partials:
            n = parts[0].numel()
            chunk = -(-n // size)
            send = torch.zeros(size, len(self.mine), chunk, dtype=parts[0].dtype, device=parts[0].device)
            for j, part in enumerate(parts):  # chunk p of each partial goes to process p
                send[:, j] = torch.nn.functional.pad(part.reshape(-1), (0, size * chunk - n)).view(size, chunk)
            recv = torch.empty(sum(in_counts) * chunk, dtype=send.dtype, device=send.device)
            futures.append(comm.alltoall(recv, send.view(-1), [c * chunk for c in in_counts], [len(self.mine) * chunk] * size))
            sent.append(send)
            received.append((recv, n, chunk))
        wait(futures)
        outs, futures = [], []
        for recv, n, chunk in received:
            inbox, off = {}, 0
            for cov in self.covers:
                for rng in cov:
                    inbox[rng] = recv[off : off + chunk]
                    off += chunk
            mine = combine(0, self.world, inbox)
            out = torch.empty(size * chunk, dtype=recv.dtype, device=recv.device)
            futures.append(comm.allgather(list(out.view(size, chunk)), mine.contiguous()))
            outs.append(out[:n])
        wait(futures)
        return outs
