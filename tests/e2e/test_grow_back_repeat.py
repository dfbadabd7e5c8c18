"""Grow-backs with a slow rank, repeated: each grow-back's first step is a few step times, never a
stall, and the injected straggler stretches the steps' compute, never their waits.

One real job (coordinator, worker processes, a real node kill each time): 2 nodes, no spare,
``cluster.min_nodes=1``; node slot 1 is killed GROW_BACKS times, each time the job shrinks onto
rank 0's process, a refill is started and the job grows back onto it (a re-forming with nothing
failed). Rank 0 is a straggler (``fault=slow``, x3) from before the first loss to the end, so
every grow-back's first step is a slow one (bench B9's grow-back case, repeated).

The task's forward waits WAIT_S before it computes (tests/e2e/tasks_for_tests/waiting_tasks.py):
a step that is mostly a wait, as a step that waits on its peers (the first step after a
re-formation, ZeRO's parameter sync, FSDP's gathers) is. The straggler used to sleep ``factor - 1``
times the step's elapsed time, waits included: every slow step took ~3x the healthy one here,
every grow-back's first step too. It now sleeps ``factor - 1`` times the step's CPU: a slow
step is the healthy one plus 2 x BURN_S.

The bounds are multiples of the healthy step time measured in the same run (rank 0's in-step
time before the straggler starts), never wall-clock constants."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENV = {"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")}
WAIT_S, BURN_S, FACTOR = 0.4, 0.03, 3
GROW_BACKS = 3  # CI; each grow-back is 26 steps of ~0.45 s
SLOW_FROM = 8  # steps 0..7 healthy: the baseline
KILLS = [12 + 26 * i for i in range(GROW_BACKS)]  # room for the refill to be built and the job to grow back between two losses
STEPS = KILLS[-1] + 24

SLOWEST_SLOW_STEP = 1.8  # x the healthy step: a slow step is WAIT_S + BURN_S + 2 x BURN_S (~1.15x); waits stretched too: ~3x
SLOWEST_RESUME = 2.5  # x the healthy step: a grow-back's first step (one slow step, ~1.15x) plus the re-formed group's first messages; waits stretched: ~2.9x

CFG = (
    "~task",
    "+task._target_=waiting_tasks.WaitingMLP",
    f"+task.wait_s={WAIT_S}",
    f"+task.burn_s={BURN_S}",
    f"train.steps={STEPS}",
    "train.reduction=fixed",
    "cluster.nodes=2",
    "cluster.spare_nodes=0",
    "cluster.min_nodes=1",
    "cluster.refill_spares=true",
    f"cluster.max_refills={GROW_BACKS}",
    "fault=kill_node",
    "fault.node=1",
    f"fault.step={KILLS[0]}",
    "fault.schedule=[" + ",".join([f"{{kind:kill_node,node:1,step:{s}}}" for s in KILLS[1:]] + [f"{{kind:slow,rank:0,step:{SLOW_FROM},duration:{STEPS},factor:{FACTOR}}}"]) + "]",
)


def test_repeated_grow_backs_with_a_slow_rank_resume_within_a_few_step_times(job):
    res = job(*CFG, env=ENV, timeout_s=560)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["status"] == "completed" and len(s["faults_fired"]) == len(s["faults"]) == GROW_BACKS + 1, (s["faults_fired"], s["faults"])
    shrunk, grown = res.of("shrunk"), res.of("grown")
    assert len(shrunk) == len(grown) == GROW_BACKS, "each loss should shrink the job and a refill grow it back before the next loss; see events.jsonl"
    assert s["workers"] == "2/2"

    steps = [e for e in res.of("step") if e.get("step") is not None]
    # rank 0's in-step time of steps 2..7 (event step = steps committed): healthy, whole, warmed up
    healthy = statistics.median(e["step_s"] for e in steps if e["gen"] == 0 and 3 <= e["step"] <= SLOW_FROM)
    grow_gens = {e["gen"] for e in grown}
    slow = [e for e in steps if e["gen"] in grow_gens]
    first = {g: min(e["step"] for e in slow if e["gen"] == g) for g in grow_gens}
    after = [e["step_s"] for e in slow if e["step"] > first[e["gen"]]]  # slow steps of a whole job, past each grow-back's first
    assert after and statistics.median(after) <= SLOWEST_SLOW_STEP * healthy, (
        f"slow steps take {statistics.median(after):.3f}s (median of {len(after)}) against {healthy:.3f}s healthy: "
        f"the straggler stretched more than the compute (x{FACTOR} of {BURN_S}s of CPU per step), the waits too"
    )

    backs = [r for r in s["moves"] if r["planned"]["kind"] == "grow"]  # a grow-back: a planned move at a step boundary
    assert len(backs) == GROW_BACKS
    for r in backs:
        assert r["t_fail"] == r["t_detect"] and r["bytes_transferred"] > 0, r
        assert r["resume_s"] <= SLOWEST_RESUME * healthy, (
            f"generation {r['gen']}: the grow-back at step {r['target_step']} took {r['resume_s']:.3f}s to its first step "
            f"(healthy step {healthy:.3f}s; every grow-back: {[round(b['resume_s'], 3) for b in backs]}); see events.jsonl and logs/"
        )
