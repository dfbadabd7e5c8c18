"""Two jobs on one machine taking turns by blocks of steps (``python -m bench.parallel_bench --interleave``).

Back-to-back runs compare a ckptless_hpc run with a plain one 30-60 s apart; on a shared machine
the load drifts over that time by more than the 2 % to be shown (pairs spread by 10-20 %). Here
both jobs are alive at once and take turns: the harness lets one run a block of a few steps
while every rank of the other waits at the end of a step, then the other way round, so each
block's two figures are a few seconds apart.

The gate is a folder of small files, one set per job (``<gate>``):

- ``<gate>.allow``: how many steps the job may complete (written by the harness, atomically);
- ``<gate>.parked.<pid>``: a rank that completed that many and waits (its count of steps);
- ``<gate>.times.<pid>``: each rank's step ends, ``steps_done time.time()`` per line, taken
  where the step's work is over (the task's ``on_step_end``, the plain worker's line after
  ``opt.step()``), the same clock on both sides.

A step interval is clean when the job ran the whole of it: within a block, from the end of its
first step to the end of its last (the first step's interval holds the wait at the gate).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from examples.llama import LlamaParallelTask

POLL_S = 0.005  # a parked rank reads the allow file 200 times a second (a few microseconds each)
PARK_TIMEOUT_S = 900.0  # a rank parked this long has lost its harness (which releases both sides when it ends)


def allowed(gate: Path) -> int:
    try:
        return int((gate.parent / f"{gate.name}.allow").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return 0


class Gate:
    """A rank's side of the gate: ``at_step_end(done)`` after each step, ``done`` steps completed."""

    def __init__(self, gate: str) -> None:
        self.gate = Path(gate)
        self.pid = os.getpid()
        self._times = open(self.gate.parent / f"{self.gate.name}.times.{self.pid}", "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def at_step_end(self, done: int) -> None:
        self._times.write(f"{done} {time.time():.6f}\n")
        if done < allowed(self.gate):
            return
        parked = self.gate.parent / f"{self.gate.name}.parked.{self.pid}"
        parked.write_text(str(done))
        deadline = time.monotonic() + PARK_TIMEOUT_S
        while done >= allowed(self.gate):
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.gate}: parked at {done} steps for {PARK_TIMEOUT_S:.0f}s, the allow file still says {allowed(self.gate)}. HINT: its harness (python -m bench.parallel_bench --interleave) is gone; run it again")
            time.sleep(POLL_S)


class GatedLlamaParallelTask(LlamaParallelTask):
    """examples.llama.LlamaParallelTask whose ranks stop at the gate after each step (``gate``: its path)."""

    def __init__(self, gate: str, **kw) -> None:
        super().__init__(**kw)
        self.gate_path = gate
        self._gate: Optional[Gate] = None

    def on_step_end(self, model, optimizer, step: int) -> None:  # noqa: ANN001
        if self._gate is None:
            self._gate = Gate(self.gate_path)
        self._gate.at_step_end(step + 1)


# ------------------------------------------------------------------------------ the harness's side
def allow(gate: Path, steps: int) -> None:
    tmp = gate.parent / f"{gate.name}.allow.tmp"
    tmp.write_text(str(steps))
    os.replace(tmp, gate.parent / f"{gate.name}.allow")


def parked_at(gate: Path) -> List[int]:
    out = []
    for p in gate.parent.glob(f"{gate.name}.parked.*"):
        try:
            out.append(int(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def wait_parked(gate: Path, ranks: int, steps: int, timeout_s: float, alive=lambda: True) -> float:  # noqa: ANN001
    """Until ``ranks`` ranks wait at ``steps`` completed steps; the time that took."""
    t0 = time.monotonic()
    while sum(1 for s in parked_at(gate) if s >= steps) < ranks:
        if time.monotonic() - t0 > timeout_s or not alive():
            raise TimeoutError(f"{gate.name}: {parked_at(gate)} ranks parked, {ranks} wanted at {steps} steps after {time.monotonic() - t0:.0f}s")
        time.sleep(0.01)
    return time.monotonic() - t0


def step_ends(gate: Path) -> Dict[int, Dict[int, float]]:
    """pid -> steps done -> the time that step ended."""
    out: Dict[int, Dict[int, float]] = {}
    for p in gate.parent.glob(f"{gate.name}.times.*"):
        ends: Dict[int, float] = {}
        for line in p.read_text().splitlines():
            n, t = line.split()
            ends[int(n)] = float(t)
        out[int(p.name.rsplit(".", 1)[1])] = ends
    return out


def block_intervals(gate: Path, first: int, last: int) -> List[float]:
    """Every rank's clean step intervals of the block that took the job from ``first`` to ``last`` steps done."""
    out: List[float] = []
    for ends in step_ends(gate).values():
        out += [ends[n] - ends[n - 1] for n in range(first + 2, last + 1) if n in ends and n - 1 in ends]
    return out


def block_pairs(blocks: List[Tuple[List[float], List[float]]]) -> List[float]:
    """Each block's ratio of the two jobs' median clean intervals (a, b): a / b."""
    from .common import median

    return [median(a) / median(b) for a, b in blocks if a and b]
