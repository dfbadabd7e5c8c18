"""A sharded worker's copies (parallel=zero|fsdp|hsdp): which shard it owns, whom it sends
copies to, what it holds for peers, and the step protocol of :mod:`ckptless_hpc.state.shards`
as the worker drives it (assign -> restore or fetch -> start_generation -> per step:
copy_confirmed before the last collective, committed after it)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from ..state.placement import REPLICATED_BY_COPIES
from ..state.shards import Copy, Replicator, ShardStore
from ..state.snapshot import state_nbytes
from ..state.transfer import Received
from .seams import EngineState, Sender

log = logging.getLogger("ckptless_hpc.worker")


class ShardCopies:
    def __init__(self, cfg: Any, secret: str, client: Sender, wake: threading.Event) -> None:
        self.mode = str(cfg.parallel.mode)
        self.every = int(cfg.replication.every)
        self.copies = self.mode in REPLICATED_BY_COPIES and int(cfg.replication.factor) > 0
        self.client = client
        self.store = ShardStore()
        self.replicator = Replicator(secret, float(cfg.cluster.recovery_timeout_s), on_error=self._error, on_change=wake.set)
        self.shard: Optional[int] = None
        self.gen = -1
        self.holders: List[Tuple[str, int, str]] = []  # (host, port, worker) of this rank's copies
        self._holds: Optional[Set[int]] = None  # shards this worker holds copies of, from the next durable step on
        self.pending: Optional[int] = None  # the step whose copy the next step's last collective waits for
        self.last_error: Optional[str] = None
        self._reported: Set[Tuple[int, str]] = set()
        # what the copies cost this process (bench B8): the steps' waits for acks, the snapshots
        self.waited_s = 0.0
        self.waits = 0
        self.snapshots = 0
        self.snapshot_bytes = 0

    def _error(self, what: str) -> None:
        self.last_error = what
        key = (self.gen, what.split(":")[0])
        if key not in self._reported:  # retried every 0.2 s: logged once per generation and holder
            self._reported.add(key)
            log.warning("replication: %s (retrying until the copy is acknowledged or the generation changes)", what)

    # ------------------------------------------------------------------ generations
    def assign(self, gen: int, shard: int, holders: List[Dict[str, Any]], holds: List[int]) -> None:
        """Generation ``gen``'s layout (an ``assign``): the shard this rank owns, the holders of its
        copies (``{"worker", "host", "port"}``), the shards it holds copies of."""
        self.gen = gen
        self.shard = int(shard)
        self.holders = [(h["host"], int(h["port"]), h["worker"]) for h in holders if h.get("port") is not None]
        if len(self.holders) != len(holders):
            log.warning("a holder of shard %d has no state port yet: %d of %d copies this generation", self.shard, len(self.holders), len(holders))
        self._holds = {int(s) for s in holds}
        self.replicator.cancel()

    def restore(self, engine: EngineState, target: int) -> bool:
        """Roll back to this worker's own snapshot of ``target`` if it has one."""
        assert self.shard is not None
        copy = self.store.get(self.shard, target, self.shard)
        if copy is None:
            return False
        engine.apply(*copy, copy=True)
        log.info("restored shard %d at step %d from its own snapshot", self.shard, target)
        return True

    def start_generation(self, engine: EngineState, step: int) -> None:
        """The step a generation starts at counts as replicated: its snapshot (taken now if this
        worker has none) goes to every holder that lacks it (a new placement, a fresh spare)."""
        copy = self.store.own.get(step)
        if copy is None:
            copy = self._snapshot(step, engine)
        self._send(step, copy)

    def _snapshot(self, step: int, engine: EngineState) -> Copy:
        copy = self.store.snapshot(step, *engine.collect(step))
        self.snapshots += 1
        self.snapshot_bytes += state_nbytes(copy[0])
        return copy

    def waited(self, seconds: float) -> None:
        """A step's last collective waited ``seconds`` for the acks of this rank's last copy."""
        self.waited_s += seconds
        self.waits += 1

    def nbytes(self) -> int:
        """Host memory its snapshots and the copies it holds for peers take."""
        return self.store.nbytes()

    def costs(self) -> Dict[str, float]:
        """For the ``done`` message: the waits, the snapshots and the bytes sent to holders."""
        return {
            "wait_s": round(self.waited_s, 6),
            "waits": self.waits,
            "snapshots": self.snapshots,
            "snapshot_bytes": self.snapshot_bytes,
            "sent_bytes": self.replicator.sent_bytes,
        }

    def _send(self, step: int, copy: Copy) -> None:
        assert self.shard is not None
        self.pending = step
        targets = [h for h in self.holders if h[2] not in self.replicator.acked(step)] if self.copies else []
        self.replicator.send(self.gen, self.shard, step, copy, targets)

    # ------------------------------------------------------------------ steps
    def copy_confirmed(self) -> bool:
        return self.pending is None or self.replicator.is_confirmed(self.pending)

    def committed(self, engine: EngineState, step: int) -> None:
        """``step`` committed here, so every rank passed its wait for its copy of ``pending``:
        that step is durable, older copies go; then this step's snapshot when it is replicated."""
        if self.pending is not None:
            self.store.durable(self.pending)
            self.replicator.forget_before(self.pending)
            if self._holds is not None:  # the new placement's copies all exist: drop what moved away
                self.store.drop_held(self._holds)
                self._holds = None
        if step % self.every == 0:
            self._send(step, self._snapshot(step, engine))

    # ------------------------------------------------------------------ serving
    def keep(self, gen: int, shard: int, step: int, got: Received) -> None:
        self.store.keep(shard, step, got)

    def get(self, shard: int, step: int) -> Optional[Copy]:
        return self.store.get(shard, step, self.shard)

    def inventory(self, live: Optional[int]) -> Dict[int, List[int]]:
        return self.store.inventory(self.shard, live)

    def describe(self, live: Optional[int]) -> str:
        return f"shard {self.shard} live at step {live}, copies {self.inventory(live)}"
