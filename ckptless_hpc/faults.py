"""Declarative fault injection keyed by (rank or node slot, step).

A fault fires inside the worker that owns it, while it computes ``step`` (after the backward
pass, before the gradient allreduce, so peers are mid-collective). The worker first tells the
coordinator which fault fires (so a replacement that reaches the same step again never
re-fires it), then acts on itself with a real signal:

- ``kill_worker``: SIGKILL to itself;
- ``kill_node``: SIGKILL to every process of its node (its process group);
- ``hang``: SIGSTOP to itself (alive but silent: heartbeats stop, peers block).

A ``slow`` fault (a straggler) kills nothing: for ``duration`` steps from ``step`` the process
that held the rank when it fired sleeps after each step's forward and backward, ``factor - 1``
times that compute (:func:`straggle_s`), never its waits on peers (:func:`compute_s`). It is that
process that is slow, as a bad node's would be: a spare that takes the rank over is healthy.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional

from .config import fault_list


KILLS = ("kill_worker", "kill_node", "hang")
WIRE = ("corrupt_transfer", "truncate_transfer")


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    step: int
    rank: Optional[int] = None
    node: Optional[int] = None
    at: str = "step"
    factor: float = 5.0
    duration: int = 20

    def describe(self) -> str:
        if self.kind == "kill_node":
            where = f"node slot {self.node}"
        elif self.kind == "kill_spare":
            where = "a waiting spare"
        else:
            where = f"rank {self.rank}"
        when = f"at step {self.step}" if self.at == "step" else f"during {self.at} (from step {self.step})"
        return f"{self.kind} of {where} {when}"

    def owner(self, rank: int, workers_per_node: int) -> bool:
        if self.kind == "kill_node":
            return self.node is not None and rank == self.node * workers_per_node  # first rank of the slot
        return self.rank == rank


def faults_from_config(cfg: Any) -> List[Fault]:
    return [Fault(index=i, **f) for i, f in enumerate(fault_list(cfg.fault))]


def due(faults: Iterable[Fault], done: Iterable[int], rank: int, workers_per_node: int, step: int, at: str = "step") -> Optional[Fault]:
    """The fault this rank must fire now (pure). ``at``: the moment the caller is at.

    "step" and "update" faults fire at exactly their step; the others (recovery, send, receive, eval) at the
    first such moment at or after their step ("eval": an evaluation after that many committed steps,
    its forwards done, before its all-reduce is launched: the peers wait in theirs). A damaged transfer strikes the next state served
    ("send"), or with ``at="optimizer"`` the next optimizer state served (the caller asks for the
    moment "optimizer" when what it serves holds the optimizer's entries). A fired fault (in ``done``) never fires again,
    so a replacement that reaches the same step does not repeat it.
    """
    fired = set(done)
    for f in faults:
        if f.index in fired or not f.owner(rank, workers_per_node):
            continue
        if f.kind in KILLS and f.at == at and (step == f.step if at in ("step", "update") else step >= f.step):
            return f
        if f.kind in WIRE and at == ("optimizer" if f.at == "optimizer" else "send") and step >= f.step:
            return f
    return None


def straggler(faults: Iterable[Fault], rank: int, step: int) -> Optional[Fault]:
    """The straggler fault active for this rank at this step, if any (pure)."""
    return next((f for f in faults if f.kind == "slow" and f.rank == rank and f.step <= step < f.step + f.duration), None)


def compute_s(elapsed_s: float, cpu_s: Optional[float]) -> float:
    """The compute part of a step so far (pure): the CPU seconds its training thread spent since
    the step's previous mark (``cpu_s``), never more than the wall time since the step started
    (``elapsed_s``). A wait on peers (a collective, a formation, a fetch) sleeps in an event and
    costs that thread no CPU, so it is left out, and so is the time it waited for a core on a
    loaded machine; the thread's work between steps (the optimizer
    update, copies) is before the step started, so the wall bound leaves it out. ``cpu_s`` None
    (no mark in this thread yet): the wall time."""
    elapsed_s = max(0.0, elapsed_s)
    return elapsed_s if cpu_s is None else min(elapsed_s, max(0.0, cpu_s))


def straggle_s(fault: Fault, compute_s: float) -> float:
    """How long a straggler sleeps after its step's forward and backward (pure): ``(factor - 1)``
    times that step's compute, so that the compute takes ``factor`` times as long. Never a
    multiple of the step's waits: a rank that waited on its peers (the first step after a
    re-formation, ZeRO's parameter sync, FSDP's gathers) is not made to sleep twice that."""
    return max(0.0, (float(fault.factor) - 1.0) * max(0.0, compute_s))


def slowdown(faults: Iterable[Fault], rank: int, step: int) -> float:
    """Compute-time multiplier of a straggler fault active for this rank at this step (1.0 = none)."""
    f = straggler(faults, rank, step)
    return f.factor if f is not None else 1.0


def spare_fault_due(faults: Iterable[Fault], done: Iterable[int], step: int) -> Optional[Fault]:
    """A kill_spare fault the coordinator must trigger now that the job reached ``step``."""
    fired = set(done)
    return next((f for f in faults if f.kind == "kill_spare" and f.index not in fired and step >= f.step), None)


def fire(fault: Fault, slurm: Any = None, cancel_step: Optional[Callable[[str, int], Any]] = None) -> None:
    """Act on this process (does not return for kills; a hang returns when SIGCONT arrives).

    ``slurm`` (a ``slurm.env.SlurmEnvironment``) and ``cancel_step`` (``slurm.commands.cancel_step``)
    are passed in by the worker, so that this bottom-layer module imports no Slurm code: under
    Slurm a kill_node ends every task of this node's step, not only this process group."""
    if fault.kind in ("kill_worker", "kill_spare"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "kill_node":
        if slurm is not None and cancel_step is not None and slurm.step_id is not None and slurm.job_id:  # Slurm: every task of this node's step
            cancel_step(slurm.job_id, slurm.step_id)
            time.sleep(60)  # the step is being killed; never train on
        os.killpg(os.getpgrp(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"fault kind {fault.kind!r} cannot fire. HINT: use kill_worker, kill_node or hang")
