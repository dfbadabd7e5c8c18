"""The communicator of one generation: a process group formed on a prefixed store.

A group of generation g is never destroyed when it breaks: destroying a group stuck on a hung
peer blocks until the group's own timeout. It is abandoned instead (kept referenced until the
process exits) and generation g+1 forms a fresh group on the store prefix ``gen<g+1>``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List

import torch
import torch.distributed as dist


def device_for(local_index: int) -> torch.device:
    """CUDA when present (one device per local worker), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_index % torch.cuda.device_count())
    return torch.device("cpu")


def connect_store(host: str, port: int, timeout_s: float) -> Any:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


class Communicator:
    """The collectives one generation's step uses, as futures (waited on interruptibly by the
    worker). ``rank`` and ``world`` never change within a generation."""

    def __init__(self, pg: Any, gen: int, rank: int, world: int) -> None:
        self.pg, self.gen, self.rank, self.world = pg, gen, rank, world

    @classmethod
    def form(cls, store: Any, gen: int, rank: int, world: int, host: str, timeout_s: float, device: torch.device) -> "Communicator":
        prefixed = dist.PrefixStore(f"gen{gen}", store)
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return cls(dist.ProcessGroupNCCL(prefixed, rank, world, opts), gen, rank, world)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return cls(dist.ProcessGroupGloo(prefixed, rank, world, opts), gen, rank, world)

    def allreduce(self, tensor: torch.Tensor) -> Any:
        """Sum ``tensor`` over the ranks, in place; a future."""
        return self.pg.allreduce([tensor]).get_future()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Any:
        """Overwrite ``tensor`` with ``root``'s, in place; a future."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.pg.broadcast([tensor], opts).get_future()


class Abandoned:
    """What a worker keeps referenced instead of destroying (broken groups, store clients)."""

    def __init__(self) -> None:
        self._kept: List[Any] = []

    def keep(self, obj: Any) -> None:
        if obj is not None:
            self._kept.append(obj)
