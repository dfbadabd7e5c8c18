"""Membership: who is who in a job, and what a loss means. Pure: no sockets, no processes, no clock.

Workers are identified as ``<node>.<local index>``; each has a role (``active``, ``spare`` or
``dead``) and, once assigned, a rank. A node that lost a worker is excluded for good: its idle
spares are never promoted. The coordinator asks this class what to do and carries it out
(killing processes, telling the launcher, writing events).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from .planner import Plan, Spare


@dataclass
class WorkerRec:
    wid: str
    node: str
    local: int
    role: str  # active | spare | leaving (a planned move's: holds and serves its state until the move is done) | dead
    writer: Any = None
    pid: Optional[int] = None
    host: Optional[str] = None
    state_port: Optional[int] = None
    built: bool = False
    last_seen: Optional[float] = None
    seen_stall: float = 0.0  # the coordinator's stall total when it was last heard (detector.py)
    reader: Any = None  # its connection's frames (protocol.FrameProtocol), once it has its config
    rank: Optional[int] = None
    ready_rank: Optional[int] = None  # the rank it last said it is ready as (it then keeps it through a rankless assign)
    compute_s: Optional[float] = None
    outbox: List[Dict[str, Any]] = field(default_factory=list)  # said before it connected


# what losing a worker means
FATAL_AT_STARTUP = "fatal_at_startup"  # an active worker died before training started: the job fails
RECOVER = "recover"  # an active worker died while training: a recovery replaces its rank
SPARE_LOST = "spare_lost"  # an idle spare died: its node is excluded, the pool refilled


def loss_kind(was_role: str, training_started: bool) -> str:
    if was_role in ("active", "leaving"):  # a worker lost while a planned move takes its rank: an ordinary recovery now
        return RECOVER if training_started else FATAL_AT_STARTUP
    return SPARE_LOST


class Membership:
    def __init__(self, workers_per_node: int) -> None:
        self.wpn = workers_per_node
        self.workers: Dict[str, WorkerRec] = {}
        self.ranks: Dict[int, str] = {}
        self.bad_nodes: Set[str] = set()
        self.active_nodes: Set[str] = set()

    def add_node(self, name: str, role: str) -> List[WorkerRec]:
        recs = [WorkerRec(f"{name}.{j}", name, j, role) for j in range(self.wpn)]
        for r in recs:
            self.workers[r.wid] = r
        return recs

    def lose(self, wid: str) -> Optional[str]:
        """Mark a worker dead; its role before, or None when it was dead already (idempotent)."""
        rec = self.workers[wid]
        if rec.role == "dead":
            return None
        was, rec.role = rec.role, "dead"
        return was

    def exclude(self, node: str) -> Optional[List[str]]:
        """Never use ``node`` again. Returns its idle spares, now dead (to be killed), or None
        when it was excluded already."""
        if node in self.bad_nodes:
            return None
        self.bad_nodes.add(node)
        self.active_nodes.discard(node)
        idle = [w for w in self.workers.values() if w.node == node and w.role == "spare"]
        for w in idle:
            w.role = "dead"
        return [w.wid for w in idle]

    def assign(self, ranks: Dict[int, str]) -> None:
        for r, wid in ranks.items():
            rec = self.workers[wid]
            rec.rank, rec.role = r, "active"

    def adopt(self, plan: Plan) -> None:
        """A recovery's plan: its rank table, and the promoted spares' nodes now in use."""
        for wid in plan.promoted.values():
            self.active_nodes.add(self.workers[wid].node)
        self.ranks = plan.ranks

    def survivors(self) -> Dict[int, str]:
        """Ranks whose worker is alive (the ones to quiesce)."""
        return {r: w for r, w in self.ranks.items() if self.workers[w].role == "active"}

    def failed(self) -> Set[str]:
        """Workers holding a rank that died, or that a planned move takes from them (leaving)."""
        return {w for w in self.ranks.values() if self.workers[w].role in ("dead", "leaving")}

    def leave(self, node: str) -> List[str]:
        """A planned move: ``node``'s ranks go to a spare. Its workers keep their state (they
        serve it) until the move is done (``release``); the recovery replaces them as failed."""
        out = [w for w in self.ranks.values() if self.workers[w].node == node and self.workers[w].role == "active"]
        for w in out:
            self.workers[w].role = "leaving"
        return out

    def release(self, wids: List[str]) -> List[str]:
        """The move is done: the leaving workers still alive are dead to the job (stopped, not lost)."""
        out = [w for w in wids if self.workers[w].role == "leaving"]
        for w in out:
            self.workers[w].role = "dead"
        return out

    def spares(self) -> List[Spare]:
        return [Spare(w.wid, w.node, w.built) for w in self.workers.values() if w.role == "spare"]

    def spare_nodes(self) -> Set[str]:
        return {w.node for w in self.workers.values() if w.role == "spare"}

    def spare_nodes_missing(self, wanted: int) -> int:
        """Spare nodes to start so that ``wanted`` are kept: counted in nodes, never in ranks (a
        node lost with all its ranks used one spare node, and is one node to refill)."""
        return max(0, wanted - len(self.spare_nodes()))

    def node_mates(self, wid: str) -> List[str]:
        """The other live ranks on ``wid``'s node: lost with it where a node's workers share one
        scheduler step (Slurm), which ends as a unit."""
        node = self.workers[wid].node
        mates = (self.workers.get(f"{node}.{j}") for j in range(self.wpn))  # O(workers per node), not O(job)
        return [w.wid for w in mates if w is not None and w.wid != wid and w.role == "active"]

    def connected_spare(self) -> Optional[WorkerRec]:
        return next((w for w in self.workers.values() if w.role == "spare" and w.writer is not None), None)

    def census(self) -> Tuple[int, int]:
        """(ranks alive, spares): O(world), for a periodic display."""
        alive = sum(1 for w in self.ranks.values() if self.workers[w].role == "active")
        return alive, sum(1 for w in self.workers.values() if w.role == "spare")

    def watched(self) -> List[WorkerRec]:
        """Workers whose silence is judged: alive, heard from, built (building is not silence)."""
        return [w for w in self.workers.values() if w.role != "dead" and w.last_seen is not None and w.built]
