"""restart.json: what a requeued job needs of the allocation before it (the emergency copy to
load, the nodes never to use again, the faults already fired, the coordinator's node). Pure
data in and out; :func:`write` is the one writer of the file, atomic (a reader never sees half a
file), and :func:`read_or_empty` a reader that never fails.

Written by the coordinator (``Coordinator._persist``: a :class:`Restart`), read back by
``SlurmJob.run_here`` after a requeue (``Coordinator.restore``), and updated by a worker's last
resort (worker/last_resort.py) when the coordinator itself is gone: :func:`after_last_resort`
is that update, on the file's own mapping, so that what the coordinator wrote is kept as it was
(its keys, their order) and only what the last resort changes is changed.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional, Union

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


#: ``after_last_resort(saved=UNCHANGED)``: a hot spare's last resort, which saved nothing.
UNCHANGED: Any = object()


def write(run_dir: str, restart: Union[Restart, Mapping[str, Any]]) -> str:
    """Replace ``run_dir``/restart.json with ``restart`` (a :class:`Restart`, or the mapping
    :func:`after_last_resort` returns) in one step (record.atomic_write); its path."""
    path = RunPaths(run_dir).restart
    write_json(path, restart.to_json() if isinstance(restart, Restart) else dict(restart))  # RecordError (the old file untouched) when it cannot
    return path


def read_or_empty(run_dir: str) -> Dict[str, Any]:
    """``run_dir``/restart.json as it is; {} when there is none or it cannot be read (the last
    resort goes on without it: a requeue from step 0 beats no requeue)."""
    try:
        with open(RunPaths(run_dir).restart, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def after_last_resort(previous: Mapping[str, Any], saved: Any = UNCHANGED, faults_done: Iterable[int] = ()) -> Dict[str, Any]:
    """What restart.json says after a headless job's last resort (pure): ``previous`` with the
    coordinator's own node excluded from now on, and, when a rank wrote (or kept) a copy,
    ``saved`` as the copy to resume from and ``faults_done`` added to the faults fired. A hot
    spare's last resort (``saved`` UNCHANGED) saved nothing: the copy and the faults stay."""
    restart = dict(previous)
    if saved is not UNCHANGED:
        restart["saved"] = saved
        restart["faults_done"] = sorted(set(restart.get("faults_done", [])) | set(faults_done))
    restart["excluded_nodes"] = sorted(set(restart.get("excluded_nodes", [])) | set(filter(None, [restart.get("batch_node")])))
    return restart


def shard_copy(load: Optional[Dict[str, Any]], shard: Optional[int]) -> Optional[Dict[str, Any]]:
    """A requeued sharded job: each rank loads its own shard's file of the emergency copy."""
    if not load or shard is None or "shards" not in load:
        return load
    one = load["shards"].get(str(shard))
    return None if one is None else {"path": one["path"], "sha256": one["sha256"], "step": load["step"], "shard": shard}
