"""A sharded rank's copies of state, kept in host memory: its own snapshots and the copies it
holds for peers, and the background sender of its own copies (docs/sharding.md).

The protocol that closes the consistency window (PARALLEL.md), for ``replication.every = 1``:

1. after step s commits on a rank, its shard is snapshot (one copy, into reused buffers) and
   the snapshot is sent to its holders in the background, overlapped with step s+1's compute;
2. before a rank contributes the last collective of step s+1 (the loss allreduce, after its
   backward), it waits until its copy of step s is acknowledged by every holder;
3. so when step s+1's collectives have completed on any rank, every rank's copy of step s exists
   (step s is *durable*), and everyone drops its snapshots and held copies older than s.

Hence at any failure every shard is held at the durable step, by its owner's snapshot or a
holder's copy, and the job resumes at the newest step every shard is held at (never a mix).
With ``every = k`` the same holds with "step" read as "replicated step" (multiples of k): a lost
shard then rolls the job back to the last copy, up to k - 1 steps. ``hsdp`` keeps the
snapshots (its rollback for a step that committed on some ranks only) and sends nothing: the
replicas of a shard are its copies.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch

from .snapshot import Entries, state_nbytes
from .transfer import CopyRefused, Received, TransferError, Unreadable, push_state

log = logging.getLogger(__name__)

Copy = Tuple[Entries, Dict[str, Any]]
LANDINGS = 2  # per shard held: dropped copies' buffer sets kept for the next copies to land in (ShardStore._to_landing)


def _copy_into(src: Entries, reuse: Optional[Entries]) -> Entries:
    """Detached host copies of ``src``, written into ``reuse``'s buffers where shapes match."""
    out: Entries = []
    old = {n: t for n, t in (reuse or [])}
    for n, t in src:
        buf = old.get(n)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype)
        buf.copy_(t.detach())
        out.append((n, buf))
    return out


class ShardStore:
    """Own snapshots (shard -> step -> copy: the rank's shard, and in a job that shrank under
    ZeRO the lost ranks' it steps) and held copies (shard -> step -> copy); thread-safe (the
    state server's threads add held copies and read both)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.own: Dict[int, Dict[int, Copy]] = {}
        self.held: Dict[int, Dict[int, Copy]] = {}
        self._spare: Dict[int, Entries] = {}  # per shard: a dropped snapshot's buffers, reused by the next
        self._landing: Dict[int, List[Entries]] = {}  # per shard: dropped held copies' buffers (LANDINGS at most), the next copies land in them

    def snapshot(self, step: int, entries: Entries, meta: Dict[str, Any], shard: int = 0) -> Copy:
        with self._lock:
            reuse = self._spare.pop(shard, None)
        copy = (_copy_into(entries, reuse), dict(meta))
        with self._lock:
            self.own.setdefault(shard, {})[step] = copy
        return copy

    def own_copy(self, shard: int, step: int) -> Optional[Copy]:
        with self._lock:
            return self.own.get(shard, {}).get(step)

    def release(self, shard: int) -> None:
        """A shard this worker no longer steps (handed back to a rank that grew the job back):
        its snapshots become held copies, served until the new placement is durable."""
        with self._lock:
            copies = self.own.pop(shard, {})
            self.held.setdefault(shard, {}).update(copies)

    def keep(self, shard: int, step: int, got: Received) -> None:
        """A holder's verified copy of ``shard`` at ``step``; the two newest per shard are kept
        (the durable step's and the one after it)."""
        with self._lock:
            copies = self.held.setdefault(shard, {})
            copies[step] = (got.entries, got.meta)
            for s in sorted(copies)[:-2]:
                self._to_landing(shard, copies.pop(s)[0])

    def _to_landing(self, shard: int, entries: Entries) -> None:
        """A dropped held copy's buffers, for the next copies of ``shard`` to land in. Two are
        kept: a holder's commit (which drops the copy before the durable step) and the next
        copy's arrival (which drops the third newest) come in either order from one step to
        the next; with one slot, the order turning one way overwrote (freed) a set and turning
        back left the next copy none, so it landed in fresh memory (a page fault per 4 KB: 0.2 to
        0.5 s more CPU for a 570 MB copy, a 100 M model's zero shard). In the step protocol held
        copies and landing buffers stay within three sets, what one of the orders held before."""
        pool = self._landing.setdefault(shard, [])
        if len(pool) < LANDINGS:
            pool.append(entries)

    def landing(self, shard: int) -> Dict[str, torch.Tensor]:
        """Buffers of a dropped copy of ``shard`` (name -> tensor) for its next copy to be received
        into: memory already touched, so the copy runs at memcpy speed, not at page-fault speed
        (about a third of a holder's CPU per copy). Taken once; empty when there is none."""
        with self._lock:
            pool = self._landing.get(shard)
            return dict(pool.pop()) if pool else {}

    def durable(self, step: int) -> None:
        """Every rank's copy of ``step`` exists: what is older can go (the newest own snapshot
        is always kept)."""
        with self._lock:
            for shard, own in self.own.items():
                newest = max(own, default=None)
                for s in [s for s in own if s < step and s != newest]:
                    entries, _ = own.pop(s)
                    self._spare[shard] = entries
            for shard, copies in self.held.items():
                for s in [s for s in copies if s < step and s != max(copies)]:
                    self._to_landing(shard, copies.pop(s)[0])

    def get(self, shard: int, step: int) -> Optional[Copy]:
        """Its own snapshot of ``shard`` at ``step``, or a held copy of it."""
        with self._lock:
            own = self.own.get(shard, {})
            if step in own:
                return own[step]
            return self.held.get(shard, {}).get(step)

    def drop_held(self, keep_shards: Optional[set] = None) -> None:
        """Forget copies of shards this worker no longer holds for (a new placement)."""
        with self._lock:
            for shard in list(self.held):
                if keep_shards is None or shard not in keep_shards:
                    del self.held[shard]
                    self._landing.pop(shard, None)

    def inventory(self, live_shards: Iterable[int], live: Optional[int]) -> Dict[int, List[int]]:
        """shard -> the steps it is held at here: held copies, own snapshots, and the ``live``
        step of the shards whose live state this worker holds."""
        with self._lock:
            inv: Dict[int, Set[int]] = {s: set(c) for s, c in self.held.items() if c}
            for shard, own in self.own.items():
                inv.setdefault(shard, set()).update(own)
            for shard in live_shards:
                if live is not None:
                    inv.setdefault(shard, set()).add(live)
            return {s: sorted(steps) for s, steps in inv.items() if steps}

    def nbytes(self) -> Dict[str, int]:
        with self._lock:
            own = sum(state_nbytes(e) for o in self.own.values() for e, _ in o.values())
            held = sum(state_nbytes(e) for c in self.held.values() for e, _ in c.values())
        return {"own": own, "held": held}


Push = Tuple[int, Copy, List[Tuple[str, int, str]]]  # (shard, copy, holders [(host, port, worker)])


class Replicator:
    """Sends this rank's snapshots (of each shard it steps) to their holders in one background
    thread, newest step first (an older step's copies still queued are dropped: the newer ones
    supersede them), retrying a holder that fails until the copy is superseded or the
    generation changes. A step is confirmed once every holder of every shard acknowledged."""

    RETRY_S = 0.2

    def __init__(self, secret: str, timeout_s: float, on_error: Callable[[str], None], on_change: Callable[[], None] = lambda: None) -> None:
        self.secret, self.timeout_s, self.on_error, self.on_change = secret, timeout_s, on_error, on_change
        self._acked: Dict[int, set] = {}  # step -> (shard, worker) pairs that acknowledged its copies
        self._cond = threading.Condition()
        self._job: Optional[Tuple[int, int, List[Push]]] = None  # (gen, step, pushes)
        self.confirmed: Dict[int, float] = {}  # step -> seconds it took (every holder acked)
        self.sent_bytes = 0
        self.cpu_s = 0.0  # its thread's CPU for the pushes (bench B8: the copy's own CPU)
        self.refused: Optional[str] = None  # a copy a holder cannot take: never retried, it ends the job
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="replicator", daemon=True)
        self._thread.start()

    def send(self, gen: int, shard: int, step: int, copy: Copy, holders: List[Tuple[str, int, str]]) -> None:
        """Queue the copy of ``step`` for ``holders`` [(host, port, worker)]; none: confirmed at once."""
        self.send_all(gen, step, [(shard, copy, list(holders))])

    def send_all(self, gen: int, step: int, pushes: List[Push]) -> None:
        """Queue the copies of ``step``, each shard's for its holders; none: confirmed at once."""
        pushes = [(shard, copy, list(holders)) for shard, copy, holders in pushes if holders]
        with self._cond:
            if not pushes:
                self.confirmed.setdefault(step, 0.0)
                self._cond.notify_all()
                self.on_change()
                return
            self.confirmed.pop(step, None)
            self._job = (gen, step, pushes)
            self._cond.notify_all()

    def acked(self, step: int) -> set:
        """The (shard, worker) pairs that acknowledged their copy of ``step``."""
        with self._cond:
            return set(self._acked.get(step, ()))

    def is_confirmed(self, step: int) -> bool:
        with self._cond:
            return step in self.confirmed

    def forget_before(self, step: int) -> None:
        with self._cond:
            for s in [s for s in self.confirmed if s < step]:
                del self.confirmed[s]
            for s in [s for s in self._acked if s < step]:
                del self._acked[s]

    def cancel(self) -> None:
        """A new generation: the queued copy's holders may be gone; the next snapshot re-sends."""
        with self._cond:
            self._job = None

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                job = self._job
            assert job is not None
            gen, step, pushes = job
            t0 = time.monotonic()
            left = [(shard, copy, holder) for shard, copy, holders in pushes for holder in holders]
            while left:
                shard, (entries, meta), (host, port, worker) = left[0]
                cpu0 = time.thread_time()
                try:
                    push_state(host, port, self.secret, gen, shard, step, entries, meta, self.timeout_s)
                    left.pop(0)
                    self.sent_bytes += state_nbytes(entries)
                    with self._cond:
                        self._acked.setdefault(step, set()).add((shard, worker))
                except (CopyRefused, Unreadable) as e:  # the same copy would be refused again: the job's error (steps.py)
                    self.refused = f"copy of shard {shard} at step {step} to {worker}: {e}"
                    self.on_error(self.refused)
                    break
                except TransferError as e:
                    self.on_error(f"copy of shard {shard} at step {step} to {worker}: {e}")
                    with self._cond:
                        if self._job is not job or self._stopped:
                            break
                        self._cond.wait(self.RETRY_S)
                finally:
                    self.cpu_s += time.thread_time() - cpu0
                with self._cond:
                    if self._job is not job:
                        break
            with self._cond:
                if not left:
                    self.confirmed[step] = time.monotonic() - t0
                if self._job is job:
                    self._job = None
                self._cond.notify_all()
            self.on_change()
