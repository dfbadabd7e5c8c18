"""How the coordinator numbers nodes and ranks, for the readers of a run directory.

An event log written before ``generation_started`` carried its ``ranks`` is read back by
re-deriving generation 0's ranks from the nodes started: the reader needs the coordinator's
own rule, and a reader imports no coordinator code (the layers run coordinator -> rundir). So
the rule lives here, below both; ``coordinator/planner.py`` imports it. Pure.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple


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
