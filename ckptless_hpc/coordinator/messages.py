"""What the coordinator says to workers, built as plain dicts by pure functions (no I/O).

Every message a coordinator sends is bounded in size whatever the world size: an ``assign``
names at most ``planner.MAX_SOURCES`` sources, never every survivor.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

Endpoint = Tuple[Optional[str], Optional[int]]  # a worker's (host, state port)


def assign(gen: int, rank: Optional[int], world: int, step: int, sources: Iterable[str], endpoints: Mapping[str, Endpoint],
           faults_done: List[int], load: Optional[Dict[str, Any]] = None, layout: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Rank ``rank`` of generation ``gen`` starts at ``step``; fetch it from ``sources`` if behind.
    ``rank`` None (no ``rank`` field): the worker keeps the rank it was last ready as.
    ``layout``: a sharded rank's shard, holders and held shards (coordinator/sharding.py)."""
    src = [{"worker": s, "host": endpoints[s][0], "port": endpoints[s][1]} for s in sources]
    msg = {"type": "assign", "gen": gen, "rank": rank, "world": world, "step": step, "sources": src, "faults_done": faults_done, **(layout or {})}
    if rank is None:
        del msg["rank"]
    if load:
        msg["load"] = load
    return msg


class Endpoints:
    """A worker's (host, state port) by id, read on demand: no per-assign copy of all workers."""

    def __init__(self, workers: Mapping[str, Any]) -> None:
        self._w = workers

    def __getitem__(self, wid: str) -> Endpoint:
        w = self._w[wid]
        return w.host, w.state_port
