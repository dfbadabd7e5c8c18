"""The worker's injected faults (``faults:`` of the config, keyed by rank, step and point): which
are due, which have fired (never repeated, also across a replacement or a requeue), and firing
one once the coordinator has recorded it."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, List, Optional, Set

from .. import faults as faultlib
from ..slurm.commands import cancel_step
from ..slurm.env import SlurmEnvironment
from ..control.messages import FaultFired
from .standing import Standing

log = logging.getLogger("ckptless_hpc.worker")

FAULT_ACK_WAIT_S = 5.0  # an injected fault waits this long at most for the coordinator to record it


class FaultInjector:
    def __init__(self, client: Any, standing: Standing) -> None:
        self.client, self.standing = client, standing
        self.faults: List[faultlib.Fault] = []
        self.workers_per_node = 1
        self.done: Set[int] = set()  # indices fired (by anyone: the coordinator's faults_done)
        self._acks: Set[int] = set()  # fault indices the coordinator has recorded as fired
        self._acked = threading.Condition()

    def arm(self, faults: List[faultlib.Fault], workers_per_node: int) -> None:
        self.faults, self.workers_per_node = faults, workers_per_node

    def ack(self, index: int) -> None:
        """The coordinator recorded fault ``index`` (``fault_ack``, from the reader thread)."""
        with self._acked:
            self._acks.add(index)
            self._acked.notify_all()

    def report(self, fault: faultlib.Fault, at: str, gen: int, step: Optional[int]) -> None:
        """Tell the coordinator that ``fault`` fires (so it is never repeated)."""
        self.client.send(FaultFired(fault.index, fault.kind, at, gen, self.standing.rank, step, os.getpid()))

    def fire(self, fault: faultlib.Fault, step: Optional[int]) -> None:
        """Report ``fault``, and act on ourselves once the coordinator has recorded it (at most
        FAULT_ACK_WAIT_S): behind a relay, a kill_node would otherwise kill the relay with the
        report still in it, and a replacement would fire the same fault again."""
        self.report(fault, fault.at, self.standing.gen, step)
        with self._acked:
            if not self._acked.wait_for(lambda: fault.index in self._acks, FAULT_ACK_WAIT_S):
                log.warning("the coordinator did not confirm fault %d within %.0fs: firing it anyway", fault.index, FAULT_ACK_WAIT_S)
        log.warning("injecting fault: %s", fault.describe())
        faultlib.fire(fault, SlurmEnvironment(), cancel_step)  # kill_node under Slurm cancels the node's step (faults.py imports no Slurm code)

    def fire_index(self, index: int, step: Optional[int]) -> None:
        """The coordinator's ``inject``: fire fault ``index`` now."""
        self.fire(self.faults[index], step)

    def due(self, at: str, step: Optional[int]) -> Optional[faultlib.Fault]:
        if self.standing.rank is None or step is None:
            return None
        return faultlib.due(self.faults, self.done, self.standing.rank, self.workers_per_node, step, at)

    def fire_due(self, at: str, step: Optional[int]) -> None:
        fault = self.due(at, step)
        if fault is not None:
            self.fire(fault, step)

    def straggle(self, step: int, t0: float) -> None:
        """An injected straggler of ``step``: alive, just slow (its compute stretched by the
        fault's factor); reported once, as it starts."""
        slow = faultlib.straggler(self.faults, self.standing.rank, step)
        if slow is None:
            return
        if slow.index not in self.done:
            self.done.add(slow.index)
            self.report(slow, "step", self.standing.gen, step)
        time.sleep((slow.factor - 1) * (time.perf_counter() - t0))
