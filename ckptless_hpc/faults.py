"""Declarative fault injection keyed by (rank or node slot, step).

A fault fires inside the worker that owns it, while it computes ``step`` (after the backward
pass, before the gradient allreduce, so peers are mid-collective). The worker first tells the
coordinator which fault fires (so a replacement that reaches the same step again never
re-fires it), then acts on itself with a real signal:

- ``kill_worker``: SIGKILL to itself;
- ``kill_node``: SIGKILL to every process of its node (its process group);
- ``hang``: SIGSTOP to itself (alive but silent: heartbeats stop, peers block).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

from .config import fault_list


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    step: int
    rank: Optional[int] = None
    node: Optional[int] = None

    def describe(self) -> str:
        where = f"rank {self.rank}" if self.kind != "kill_node" else f"node slot {self.node}"
        return f"{self.kind} of {where} at step {self.step}"


def faults_from_config(cfg: Any) -> List[Fault]:
    return [Fault(index=i, **f) for i, f in enumerate(fault_list(cfg.fault))]


def due(faults: Iterable[Fault], done: Iterable[int], rank: int, workers_per_node: int, step: int) -> Optional[Fault]:
    """The fault this rank must fire at this step, if any (pure)."""
    fired = set(done)
    for f in faults:
        if f.index in fired or f.step != step:
            continue
        if f.kind in ("kill_worker", "hang") and f.rank == rank:
            return f
        # the first rank of the node slot fires a node kill, for the whole node
        if f.kind == "kill_node" and rank == f.node * workers_per_node:
            return f
    return None


def fire(fault: Fault) -> None:
    """Act on this process (does not return for kills; a hang returns when SIGCONT arrives)."""
    if fault.kind == "kill_worker":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "kill_node":
        from .slurm.env import SlurmEnvironment

        env = SlurmEnvironment()
        if env.step_id is not None and env.job_id:  # Slurm: every task of this node's step
            from .slurm.commands import cancel_step

            cancel_step(env.job_id, env.step_id)
            time.sleep(60)  # the step is being killed; never train on
        os.killpg(os.getpgrp(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"fault kind {fault.kind!r} cannot fire. HINT: use kill_worker, kill_node or hang")
