"""A generation's process group as the worker holds it: formed on a store client of its own,
let go of after a failed or abandoned step, and the past generations' groups and store clients
retired once a newer generation works (an abandoned gloo group is never destroyed: that could
block; train/comm.py)."""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from ..control.client import exit_now
from ..train import cuda
from ..train.comm import Communicator, DeadlineExceeded, Retired, connect_store, within
from .seams import EngineGroups
from .exits import EXIT_CUDA_POISONED, EXIT_WEDGED

log = logging.getLogger("ckptless_hpc.worker")


class Groups:
    def __init__(self, cfg: Any, engine: EngineGroups, store_addr: str, secret: str, host: str, device: torch.device, backend: Optional[str]) -> None:
        self.cluster, self.engine = cfg.cluster, engine
        self.store_addr, self.secret, self.host = store_addr, secret, host
        self.device, self.backend = device, backend
        self.comm: Optional[Communicator] = None
        self._retired = Retired()  # past generations' groups and store clients, released once idle
        self._released_before = 0

    def form(self, gen: int, rank: int, world: int, holders: Optional[List[List[int]]] = None) -> Communicator:
        """Generation ``gen``'s group, on a store client of its own (an abandoned formation may
        block its client forever); both are retired with the generation. ``holders``: the ranks
        each process trains, in a job that shrank (train/comm.py)."""
        self._retired.forming(gen, True)
        try:
            host, _, port = self.store_addr.rpartition(":")
            store = connect_store(host, int(port), self.secret, self.cluster.recovery_timeout_s)
            self._retired.keep(gen, store)
            comm = Communicator.form(store, gen, rank, world, self.host, self.cluster.collective_timeout_s, self.device, self.backend, holders)
            self.engine.form_groups(store, comm, self.host, self.cluster.collective_timeout_s)
            return comm
        finally:
            self._retired.forming(gen, False)

    def works(self, gen: int) -> None:
        """A step of ``gen`` committed: what the older generations left can go."""
        if gen > self._released_before:
            self._released_before = gen
            self._retired.release_before(gen)

    def abandon(self) -> None:
        """Let go of the generation's group after a failed or abandoned step: NCCL's is aborted and
        the CUDA stream checked, each under cluster.abort_timeout_s; a process where either does
        not return is lost, and exits to be replaced by a spare."""
        comm, self.comm = self.comm, None
        if comm is None:
            return
        deadline = self.cluster.abort_timeout_s
        try:
            comm.release(deadline)
            if not self.engine.let_go(comm):
                self._retired.keep(comm.gen, comm)
            if self.device.type == "cuda":
                within(lambda: torch.cuda.synchronize(self.device), deadline, "CUDA stream check")
        except DeadlineExceeded as e:
            log.error("%s: this process cannot take part any more; exiting to be replaced by a spare", e)
            exit_now(EXIT_WEDGED)
        except Exception as e:  # noqa: BLE001 - a broken context is not recovered in place
            if cuda.poisons_context(e):
                log.error("CUDA error while releasing generation %d: %s; exiting to be replaced by a spare", comm.gen, e)
                exit_now(EXIT_CUDA_POISONED)
            log.warning("releasing generation %d: %s", comm.gen, e)
