"""The worker's injected faults (``faults:`` of the config, keyed by rank, step and point): which
are due, which have fired (never repeated, also across a replacement or a requeue), and firing
one once the coordinator has recorded it."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import List, Optional, Set, Tuple

from .. import faults as faultlib
from ..slurm.commands import cancel_step
from ..slurm.env import SlurmEnvironment
from ..control.messages import FaultFired
from .seams import Sender
from .standing import Standing

log = logging.getLogger("ckptless_hpc.worker")

FAULT_ACK_WAIT_S = 5.0  # an injected fault waits this long at most for the coordinator to record it


class FaultInjector:
    def __init__(self, client: Sender, standing: Standing) -> None:
        self.client, self.standing = client, standing
        self.faults: List[faultlib.Fault] = []
        self.workers_per_node = 1
        self.done: Set[int] = set()  # indices fired (by anyone: the coordinator's faults_done)
        self.slowing: Set[int] = set()  # the stragglers this process fired: it is the slow one, not whoever takes its rank later
        self._acks: Set[int] = set()  # fault indices the coordinator has recorded as fired
        self._acked = threading.Condition()
        # (thread, its CPU seconds) at the training thread's last mark: where the compute of the
        # next step's forward and backward is counted from (straggle)
        self._mark: Optional[Tuple[int, float]] = None

    def arm(self, faults: List[faultlib.Fault], workers_per_node: int) -> None:
        """The config's faults; called by the thread that trains, once its model is built."""
        self.faults, self.workers_per_node = faults, workers_per_node
        self._set_mark()

    def _set_mark(self) -> None:
        self._mark = (threading.get_ident(), time.thread_time())

    def _trainer_mark(self) -> None:
        """The training thread is between two pieces of its work (an optimizer update done, an
        evaluation's forwards done, an abort taken): what it computes next is counted from here.
        Other threads (a fetch, the state server) fire faults too: they move no mark."""
        if self._mark is not None and self._mark[0] == threading.get_ident():
            self._set_mark()

    def _cpu_since_mark(self) -> Optional[float]:
        mark = self._mark
        if mark is None or mark[0] != threading.get_ident():
            return None
        return time.thread_time() - mark[1]

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
        self._trainer_mark()

    def straggle(self, step: int, t0: float) -> None:
        """An injected straggler of ``step`` (called after its forward and backward; ``t0``: the
        step's start, ``time.perf_counter()``): alive, just slow, its compute stretched by the
        fault's factor; reported once, as it starts. The process that fires it is the slow one
        (a bad node's): a process that takes the rank over later (a spare after a move) is not.

        The sleep is ``factor - 1`` times the step's compute (faults.compute_s: the CPU seconds
        this thread spent since its last mark, at most the wall time since ``t0``), not the wall
        time since ``t0``: that includes the step's waits on its peers (ZeRO's parameter sync,
        FSDP's gathers; the first step after a re-formation may wait long for a peer still
        fetching) and, on a loaded machine, its waits for a core (B9's 10.8 M grow-back on 2
        shared cores: 1.3 s of CPU in up to 6.7 s, slept x2: 13.4 s), and a sleep of twice a long
        wait would then stall the peers on it in turn."""
        elapsed_s, cpu_s = time.perf_counter() - t0, self._cpu_since_mark()
        slow = faultlib.straggler(self.faults, self.standing.rank, step)
        if slow is not None and slow.index not in self.done:  # this process fires it: the process is slow, as a bad node's is
            self.slowing.add(slow.index)
        if slow is not None and slow.index in self.slowing:  # fired by another process (a spare took the rank over, a move): healthy
            compute_s = faultlib.compute_s(elapsed_s, cpu_s)
            sleep_s = faultlib.straggle_s(slow, compute_s)
            if slow.index not in self.done:
                self.done.add(slow.index)
                self.report(slow, "step", self.standing.gen, step)
                log.warning(
                    "straggler fault %d: from step %d, for %d steps, the compute is stretched x%g (step %d: %.3fs of compute in the %.3fs since it started, sleeping %.3fs)",
                    slow.index,
                    slow.step,
                    slow.duration,
                    slow.factor,
                    step,
                    compute_s,
                    elapsed_s,
                    sleep_s,
                )
            time.sleep(sleep_s)
        self._set_mark()  # this thread trains: the next step's compute is counted from here
