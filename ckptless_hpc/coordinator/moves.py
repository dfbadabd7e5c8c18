"""Planned moves as pure decisions: which node's ranks to hand to a spare, and at which step.

A move is a change of membership the job chooses rather than suffers: a node drained by its
administrator (``ckptless-hpc drain``, or Slurm's ``DRAIN`` state), a straggler under
``cluster.straggler_action=replace``, or a grow-back after a shrink. It happens at a step
boundary: every rank finishes the steps before it, holds there, and the new generation starts
at it, so no step is aborted or redone (job.py runs it through recovery.py, planned). No
sockets, processes or clocks here: time and steps are arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

LEAD_S = 0.5  # how far ahead of the last committed step the boundary is put, in seconds of steps
MIN_MARGIN = 2  # ... and in steps: rank 0's metrics arrive after its commit, the hold must arrive before the boundary

DRAIN, STRAGGLER, GROW = "drain", "straggler", "grow"


def boundary_step(step: int, step_s: Optional[float], last_step: int, lead_s: float = LEAD_S, min_margin: int = MIN_MARGIN) -> Optional[int]:
    """The step at which a move takes effect: ``step`` (the newest committed step the
    coordinator heard of) plus a margin of at least ``min_margin`` steps and ``lead_s`` seconds
    of steps (``step_s``: the step time, None when unknown), so that every rank hears of it
    before it gets there. None when the job ends first (the boundary would be ``last_step`` or
    past it): nothing is moved in a job about to finish."""
    margin = min_margin
    if step_s is not None and step_s > 0:
        margin = max(min_margin, math.ceil(lead_s / step_s))
    s = step + margin
    return s if s < last_step else None


@dataclass(frozen=True)
class Request:
    node: str
    kind: str  # drain | straggler
    reason: str


class MoveRules:
    """The moves asked for and what is allowed, per node. A node is moved once: a drained or
    slow node's workers leave for good (the node is excluded). A rank that stays slow after it
    was moved for straggling is not blamed again (the slowness went with the rank, not the
    node: its data, its place in the model), so no move ping-pongs between nodes."""

    def __init__(self) -> None:
        self.wanted: Dict[str, Request] = {}  # node -> the request, until it is carried out or refused
        self.moved_ranks: Set[int] = set()  # ranks moved for straggling once: never again
        self.kept: Set[int] = set()  # stragglers reported as kept (no spare): reported once

    def ask(self, node: str, kind: str, reason: str, active_nodes: Iterable[str], bad_nodes: Iterable[str]) -> Optional[str]:
        """Take a request; a reason when it is refused (a node the job does not train on)."""
        if node in set(bad_nodes):
            return f"node {node} is excluded already"
        if node not in set(active_nodes):
            return f"node {node} holds no rank of this job (its nodes: {', '.join(sorted(active_nodes)) or 'none'})"
        if node not in self.wanted or kind == DRAIN:  # a drain outranks a straggler's request
            self.wanted[node] = Request(node, kind, reason)
        return None

    def straggler(self, rank: int, node: str, ratio: float, window: int) -> Optional[Tuple[str, str]]:
        """A rank judged slow (detector.py): (node, reason) to move, or None when it was moved once already."""
        if rank in self.moved_ranks:
            return None
        return node, f"rank {rank} straggled: {ratio:.1f}x slower than the typical rank over {window} steps"

    def due(self, spares_by_node: int, per_node_needed: Mapping[str, int]) -> List[Request]:
        """The requests to carry out now: as many whole nodes as the built spare nodes can take
        (``spares_by_node``: usable spare nodes; a node's ranks go to one spare node), drains
        first, then by node name. The rest wait for a spare."""
        order = sorted(self.wanted.values(), key=lambda r: (r.kind != DRAIN, r.node))
        return [r for r in order if per_node_needed.get(r.node, 0) > 0][:spares_by_node]

    def taken(self, reqs: Iterable[Request], ranks_of: Mapping[str, List[int]]) -> None:
        """These requests are being carried out."""
        for r in reqs:
            self.wanted.pop(r.node, None)
            if r.kind == STRAGGLER:
                self.moved_ranks.update(ranks_of.get(r.node, ()))

    def drop(self, node: str) -> Optional[Request]:
        """A node lost (failed) or excluded meanwhile: its request goes (a recovery replaces it)."""
        return self.wanted.pop(node, None)
