"""The communicator of one generation: a process group formed on a prefixed store.

A group of generation g is never destroyed when it breaks: destroying a group stuck on a hung
peer blocks until the group's own timeout. A gloo group is abandoned instead (kept referenced
until the process exits); an NCCL communicator is aborted, under a deadline (abandoning it
would leak GPU memory and threads per generation, and ``abort()`` itself can hang on a wedged
peer: a process whose abort does not return is lost, and is replaced). Generation g+1 forms a
fresh group on the store prefix ``gen<g+1>``.

Every formation ends with a barrier on the same store prefix (:func:`store_barrier`): no rank
returns from ``form`` before every rank of the generation has arrived. gloo's eager setup is such
a barrier already (each pair connects at formation); its lazy setup (``TORCH_GLOO_LAZY_INIT=1``,
``cluster.gloo_lazy_connect``) returns at once, and without the barrier a survivor could start
the resumed step before a replacement has fetched the state it serves.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Set

import torch
import torch.distributed as dist


class DeadlineExceeded(Exception):
    """A call that must return in bounded time did not (an NCCL abort, a CUDA stream check):
    this process can no longer be trusted to take part, and is replaced."""


def within(fn: Callable[[], Any], deadline_s: float, what: str) -> Any:
    """Run ``fn`` in a helper thread and return its result, or raise DeadlineExceeded when it
    has not returned after ``deadline_s`` (the thread is left behind: it may never return)."""
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=what, daemon=True).start()
    if not done.wait(deadline_s):
        raise DeadlineExceeded(f"{what} did not return within {deadline_s:.1f}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def connect_store(host: str, port: int, secret: str, timeout_s: float) -> Any:
    """A client of the job's authenticated rendezvous store (ckptless_hpc.control.rendezvous)."""
    from ..control.rendezvous import AuthStore

    return AuthStore(host, port, secret, timeout_s)


def store_barrier(store: Any, world: int, timeout_s: float, name: str = "formed") -> None:
    """Return once all ``world`` ranks have called this on ``store`` (a prefixed store of one
    generation): one counter every rank increments, and one key the last arrival sets and every
    rank waits on: two store round trips per rank whatever the world size, no gloo pair."""
    if store.add(f"{name}/count", 1) >= world:
        store.set(f"{name}/open", b"1")
    store.wait([f"{name}/open"], timedelta(seconds=timeout_s))


class Communicator:
    """The collectives one generation's step uses, as futures (waited on interruptibly by the
    worker). ``rank`` and ``world`` never change within a generation. ``holders``: the virtual
    ranks each process of the generation trains (train/fixed.py), ``None`` while process ``r``
    trains virtual rank ``r`` alone (every generation of a job that has not shrunk)."""

    def __init__(self, pg: Any, gen: int, rank: int, world: int, backend: str = "gloo", holders: Optional[List[List[int]]] = None) -> None:
        self.pg, self.gen, self.rank, self.world, self.backend = pg, gen, rank, world, backend
        self.holders = holders
        # virtual rank -> the process that trains it (a job that shrank): built once, asked per owner each step (ZeRO)
        self._process = {v: p for p, vs in enumerate(holders) for v in vs} if holders is not None else None
        self.aborted = False

    @property
    def vranks(self) -> List[int]:
        """The virtual ranks this process trains in this generation."""
        return list(self.holders[self.rank]) if self.holders is not None else [self.rank]

    def process_of(self, vrank: int) -> int:
        """The rank in this generation's group of the process that trains virtual rank ``vrank``."""
        return vrank if self._process is None else self._process[vrank]

    @classmethod
    def form(
        cls,
        store: Any,
        gen: int,
        rank: int,
        world: int,
        host: str,
        timeout_s: float,
        device: torch.device,
        backend: Optional[str] = None,
        holders: Optional[List[List[int]]] = None,
    ) -> "Communicator":
        """The group of generation ``gen``: NCCL for CUDA tensors unless ``backend`` says gloo
        (gloo also reduces CUDA tensors, through host memory: ranks may then share a GPU)."""
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        prefixed = dist.PrefixStore(f"gen{gen}", store)
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
            if hasattr(pg, "eager_connect_single_device"):  # connect now, not inside the first step
                pg.eager_connect_single_device(device)
            store_barrier(prefixed, world, timeout_s)
            return cls(pg, gen, rank, world, "nccl", holders)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        pg = dist.ProcessGroupGloo(prefixed, rank, world, opts)  # lazy setup (TORCH_GLOO_LAZY_INIT=1): no pair connected yet
        store_barrier(prefixed, world, timeout_s)
        return cls(pg, gen, rank, world, "gloo", holders)

    def release(self, deadline_s: float) -> None:
        """Let go of this generation's group after a failed or abandoned step. NCCL: abort the
        communicator, bounded by ``deadline_s`` (DeadlineExceeded: this process is lost). gloo:
        nothing to do (the caller keeps the object referenced; destroying it could block)."""
        if self.backend != "nccl" or self.aborted:
            return
        self.aborted = True
        within(self.pg.abort, deadline_s, f"NCCL abort of generation {self.gen}")

    def allreduce(self, tensor: torch.Tensor) -> Any:
        """Sum ``tensor`` over the ranks, in place; a future."""
        return self.pg.allreduce([tensor]).get_future()

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits: List[int], in_splits: List[int]) -> Any:
        """Split ``inp`` by ``in_splits``, piece ``p`` to rank ``p``; ``out`` receives rank ``q``'s
        piece for this rank in its ``out_splits[q]`` elements; a future."""
        return self.pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).get_future()

    def allgather(self, outs: List[torch.Tensor], tensor: torch.Tensor) -> Any:
        """Every rank's ``tensor`` into ``outs[rank]`` (equal sizes); a future."""
        return self.pg.allgather([outs], [tensor]).get_future()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Any:
        """Overwrite ``tensor`` with ``root``'s, in place; a future."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.pg.broadcast([tensor], opts).get_future()


class Retired:
    """What past generations leave behind (their group, their store client), released once it
    cannot be in use any more: after a later generation has committed a step, and never while
    the formation that uses it may still run (a formation abandoned mid-way can block its store
    client forever). The release runs in a thread of its own: the objects' destructors (which
    torch runs without the GIL) wait for their groups' threads, so a group still stuck on an
    unreachable peer holds only that thread, never the training loop. A gloo group keeps a
    socket per peer and threads: without this a survivor gains descriptors and threads at every
    recovery."""

    def __init__(self) -> None:
        self._kept: Dict[int, List[Any]] = {}
        self._forming: Set[int] = set()
        self._lock = threading.Lock()
        self.released = 0

    def keep(self, gen: int, obj: Any) -> None:
        if obj is not None:
            with self._lock:
                self._kept.setdefault(gen, []).append(obj)

    def forming(self, gen: int, running: bool) -> None:
        with self._lock:
            (self._forming.add if running else self._forming.discard)(gen)

    def release_before(self, gen: int) -> int:
        """Drop what generations older than ``gen`` left (those not still forming); returns how many."""
        with self._lock:
            old = [g for g in self._kept if g < gen and g not in self._forming]
            batch = [obj for g in old for obj in self._kept.pop(g)]
        if batch:
            self.released += len(batch)
            threading.Thread(target=batch.clear, name=f"release<gen{gen}", daemon=True).start()
        return len(batch)


def resources() -> Dict[str, float]:
    """This process's open descriptors, OS threads and resident memory (Linux /proc)."""
    import os

    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")), "rss_mb": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)}
