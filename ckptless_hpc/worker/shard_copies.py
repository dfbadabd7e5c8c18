"""A sharded worker's copies (parallel=zero|fsdp|hsdp): which shard it owns, whom it sends
copies to, what it holds for peers, and the step protocol of :mod:`ckptless_hpc.state.shards`
as the worker drives it (assign -> restore or fetch -> start_generation -> per step:
copy_confirmed before the last collective, committed after it).

In a job that shrank under ZeRO (``cluster.min_nodes``) a survivor also steps lost ranks' shards
(``adopted``): each is snapshot, copied to its own holders and served like the rank's own, and
handed back (:meth:`ShardCopies.release`) when a spare grows the job back."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from ..config import Shape
from ..config import group_size
from ..state.placement import sends_copies
from ..state.shards import Copy, Replicator, ShardStore
from ..state.snapshot import state_nbytes
from ..state.transfer import Received
from .seams import EngineState, Sender

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ckptless_hpc.worker")


class ShardCopies:
    def __init__(self, cfg: Any, secret: str, client: Sender, wake: threading.Event) -> None:
        self.mode = str(cfg.parallel.mode)
        self.every = int(cfg.replication.every)
        one_replica = self.mode in ("tp", "pp") and sends_copies(self.mode, Shape.of(cfg).world, group_size(cfg.parallel))
        self.copies = (sends_copies(self.mode, 0, None) or one_replica) and int(cfg.replication.factor) > 0
        self.client = client
        self.store = ShardStore()
        self.replicator = Replicator(secret, float(cfg.cluster.recovery_timeout_s), on_error=self._error, on_change=wake.set)
        self.shard: Optional[int] = None
        self.gen = -1
        self.holders: Dict[int, List[Tuple[str, int, str]]] = {}  # shard it steps -> (host, port, worker) of its copies
        self.live: Set[int] = set()  # the adopted shards whose live state it holds (once loaded)
        self._holds: Optional[Set[int]] = None  # shards this worker holds copies of, from the next durable step on
        self.pending: Optional[int] = None  # the step whose copy the next step's last collective waits for
        self.last_error: Optional[str] = None
        self._reported: Set[Tuple[int, str]] = set()
        # what the copies cost this process (bench B8): the steps' waits for acks, the snapshots
        self.waited_s = 0.0
        self.waits = 0
        self.snapshots = 0
        self.received_cpu_s = 0.0  # the CPU of receiving and keeping the copies it holds for peers
        self.received = 0
        self._count_lock = threading.Lock()
        self.snapshot_bytes = 0

    def _error(self, what: str) -> None:
        self.last_error = what
        key = (self.gen, what.split(":")[0])
        if key not in self._reported:  # retried every 0.2 s: logged once per generation and holder
            self._reported.add(key)
            log.warning("replication: %s (retrying until the copy is acknowledged or the generation changes)", what)

    # ------------------------------------------------------------------ generations
    def assign(self, gen: int, shard: int, holders: List[Dict[str, Any]], holds: List[int], adopted: Optional[Dict[int, List[Dict[str, Any]]]] = None) -> None:
        """Generation ``gen``'s layout (an ``assign``): the shard this rank owns, the holders of its
        copies (``{"worker", "host", "port"}``), the shards it holds copies of; ``adopted``: the
        lost ranks' shards it steps too (a job that shrank, ZeRO), each with its holders."""
        self.gen = gen
        self.shard = int(shard)
        self.holders = {}
        for s, hs in [(self.shard, holders), *sorted((adopted or {}).items())]:
            self.holders[int(s)] = [(h["host"], int(h["port"]), h["worker"]) for h in hs if h.get("port") is not None]
            if len(self.holders[int(s)]) != len(hs):
                log.warning("a holder of shard %d has no state port yet: %d of %d copies this generation", s, len(self.holders[int(s)]), len(hs))
        self.live &= set(self.owned[1:])
        self._holds = {int(s) for s in holds}
        self.replicator.cancel()

    @property
    def owned(self) -> List[int]:
        """The shards it steps: its rank's, then the adopted ones."""
        return list(self.holders)

    def restore(self, engine: EngineState, target: int) -> bool:
        """Roll back to this worker's own snapshot of ``target`` if it has one."""
        assert self.shard is not None
        copy = self.store.own_copy(self.shard, target)
        if copy is None:
            return False
        engine.apply(*copy, copy=True)
        log.info("restored shard %d at step %d from its own snapshot", self.shard, target)
        return True

    def take_over(self, engine: EngineState, target: int, live_step: Optional[int]) -> List[int]:
        """The adopted shards at ``target`` (ZeRO, a job that shrank): those already live at it
        stay, the others come from this worker's own snapshots or the copies it holds; returns
        the shards it must fetch from peers (:meth:`loaded` once in)."""
        missing = []
        for shard in self.owned[1:]:
            if (shard in self.live or target == 0) and live_step == target:  # step 0: every part is the seeded init
                self.live.add(shard)
                continue
            copy = self.store.get(shard, target)
            if copy is None:
                self.live.discard(shard)
                missing.append(shard)
                continue
            engine.apply(*copy, copy=True, shard=shard)
            self.live.add(shard)
            log.info("took over shard %d at step %d from %s", shard, target, "its own snapshot" if self.store.own_copy(shard, target) else "the copy it held")
        return missing

    def loaded(self, shard: int) -> None:
        """The live state of adopted ``shard`` is in (fetched from a peer)."""
        self.live.add(shard)

    def release(self, shards: List[int], engine: EngineState, step: Optional[int]) -> None:
        """Shards it no longer steps (a spare grew the job back and takes them): their state at
        ``step`` (snapshot now if it has none) and older snapshots become held copies, served to
        the spare and kept until the new placement is durable."""
        for shard in shards:
            if step is not None and shard in self.live and self.store.own_copy(shard, step) is None:
                self._snapshot(step, engine, shard)
            self.store.release(shard)
            self.live.discard(shard)

    def start_generation(self, engine: EngineState, step: int) -> None:
        """The step a generation starts at counts as replicated: its snapshot of each shard it
        steps (taken now where it has none) goes to every holder that lacks it (a new
        placement, a fresh spare)."""
        self.live.update(self.owned[1:])
        copies = {shard: self.store.own_copy(shard, step) or self._snapshot(step, engine, shard) for shard in self.owned}
        self._send(step, copies)

    def _snapshot(self, step: int, engine: EngineState, shard: int) -> Copy:
        copy = self.store.snapshot(step, *engine.collect(step, shard=shard), shard=shard)
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
            # the copy's own threads (time.thread_time): the sender's pushes, the holder's receives
            "send_cpu_s": round(self.replicator.cpu_s, 6),
            "receive_cpu_s": round(self.received_cpu_s, 6),
            "received": self.received,
        }

    def _send(self, step: int, copies: Dict[int, Copy]) -> None:
        self.pending = step
        acked = self.replicator.acked(step)
        pushes = [(shard, copy, [h for h in self.holders[shard] if (shard, h[2]) not in acked] if self.copies else []) for shard, copy in copies.items()]
        self.replicator.send_all(self.gen, step, pushes)

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
            self._send(step, {shard: self._snapshot(step, engine, shard) for shard in self.owned})

    # ------------------------------------------------------------------ serving
    def keep(self, gen: int, shard: int, step: int, got: Received) -> None:
        cpu0 = time.thread_time()
        self.store.keep(shard, step, got)
        with self._count_lock:  # pushes from several senders land at once (replication.factor > 1)
            self.received_cpu_s += got.cpu_s + time.thread_time() - cpu0
            self.received += 1

    def landing(self, shard: int) -> Dict[str, torch.Tensor]:
        return self.store.landing(shard)

    def get(self, shard: int, step: int) -> Optional[Copy]:
        return self.store.get(shard, step)

    def live_shards(self) -> List[int]:
        """The shards whose live state it holds: its rank's, and the adopted ones once loaded."""
        return [] if self.shard is None else [self.shard, *(s for s in self.owned[1:] if s in self.live)]

    def inventory(self, live: Optional[int]) -> Dict[int, List[int]]:
        return self.store.inventory(self.live_shards(), live)

    def describe(self, live: Optional[int]) -> str:
        shards = ", ".join(str(s) for s in self.owned) or "none"
        return f"shard(s) {shards} live at step {live}, copies {self.inventory(live)}"
