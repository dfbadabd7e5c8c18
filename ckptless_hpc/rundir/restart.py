"""restart.json: what a requeued job needs of the allocation before it (the emergency copy to
load, the nodes never to use again, the faults already fired, the coordinator's node). Pure
data in and out; ``write`` is the one file operation, atomic (a reader never sees half a file).

Read back by ``SlurmJob.run_here`` after a requeue (``Coordinator.restore``) and updated by a
worker's last resort (worker/last_resort.py) when the coordinator itself is gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterable, Optional

from .paths import RESTART, RunPaths
from .record import write_json

FILE = RESTART


@dataclass(frozen=True)
class Restart:
    saved: Optional[Dict[str, Any]] = None  # the emergency copy (path, step, sha256[, shards])
    excluded_nodes: FrozenSet[str] = frozenset()
    faults_done: FrozenSet[int] = frozenset()  # fault indices already fired: never fired again
    batch_node: Optional[str] = None  # the coordinator's node (None: on no worker node)

    @classmethod
    def of(cls, saved: Optional[Dict[str, Any]], excluded_nodes: Iterable[str], faults_done: Iterable[int], batch_node: Optional[str]) -> "Restart":
        return cls(saved, frozenset(excluded_nodes), frozenset(faults_done), batch_node)

    def to_json(self) -> Dict[str, Any]:
        return {"saved": self.saved, "excluded_nodes": sorted(self.excluded_nodes), "faults_done": sorted(self.faults_done), "batch_node": self.batch_node}

    @classmethod
    def from_json(cls, state: Dict[str, Any]) -> "Restart":
        """A previous run's restart.json as read; a key it lacks is empty."""
        return cls.of(state.get("saved"), state.get("excluded_nodes", []), state.get("faults_done", []), state.get("batch_node"))


def write(run_dir: str, restart: Restart) -> str:
    """Replace ``run_dir``/restart.json with ``restart`` in one step (record.atomic_write); its path."""
    path = RunPaths(run_dir).restart
    write_json(path, restart.to_json())  # RecordError (the old file untouched) when it cannot
    return path


def shard_copy(load: Optional[Dict[str, Any]], shard: Optional[int]) -> Optional[Dict[str, Any]]:
    """A requeued sharded job: each rank loads its own shard's file of the emergency copy."""
    if not load or shard is None or "shards" not in load:
        return load
    one = load["shards"].get(str(shard))
    return None if one is None else {"path": one["path"], "sha256": one["sha256"], "step": load["step"], "shard": shard}
