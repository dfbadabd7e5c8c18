"""How the coordinator numbers nodes and ranks, for the readers of a run directory.

An event log written before ``generation_started`` carried its ``ranks`` is read back by
re-deriving generation 0's ranks from the nodes started: the reader needs the coordinator's
own rule, and a reader imports no coordinator code (the layers run coordinator -> rundir). So
the rule lives here, below both; ``coordinator/planner.py`` imports it. Pure.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple, TypeVar

T = TypeVar("T")


def node_order(name: str) -> Tuple:
    """Nodes sort as the coordinator numbers them: local2 < local10."""
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1, name)


def initial_ranks(nodes: Sequence[Tuple[str, Sequence[str]]]) -> Dict[int, str]:
    """Rank r lives on node r // workers_per_node: ranks are numbered node by node."""
    ranks: Dict[int, str] = {}
    for _, workers in nodes:
        for w in workers:
            ranks[len(ranks)] = w
    return ranks


def shrunk(world: int, lost: Sequence[int]) -> Tuple[List[int], List[List[int]]]:
    """A generation in which the ranks ``lost`` have no process (a job that shrank, ``cluster.min_nodes``):
    the live ranks in order are its processes (process ``p`` is rank ``live[p]``), and the lost
    ranks are dealt over them, spread evenly (lost rank ``i`` of ``k`` to process ``i * L // k``,
    so a lost rank 0 goes to process 0, which then trains rank 0). Returns (live, the ranks each
    process trains: its own first)."""
    gone = sorted(set(int(r) for r in lost))
    live = [r for r in range(world) if r not in set(gone)]
    if not live:
        raise ValueError(f"every rank of {world} is lost: nothing to shrink to")
    holders = [[r] for r in live]
    for i, r in enumerate(gone):
        holders[i * len(live) // len(gone)].append(r)
    return live, holders


def trained_by(ranks: Mapping[int, T], world: int) -> Dict[int, T]:
    """Every rank of ``0..world-1`` -> the process that trains it: its own (``ranks``), or for a
    rank a shrink left without one, the survivor :func:`shrunk` deals it to."""
    if len(ranks) == world:
        return dict(ranks)
    live, holders = shrunk(world, [r for r in range(world) if r not in ranks])
    return {v: ranks[r] for r, vs in zip(live, holders) for v in vs}
