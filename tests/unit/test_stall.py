"""A job that commits no step (coordinator/stall.py, train.stall_timeout_s): pure, only ``now`` moves."""

from __future__ import annotations

import pytest

from ckptless_hpc.coordinator.job import Finish, Inputs, JobMachine, Options, Phase, StartTraining
from ckptless_hpc.coordinator.sharding import Layout
from ckptless_hpc.coordinator.stall import FACTOR, FLOOR_S, StallWatch
from ckptless_hpc.coordinator.verdicts import EXIT_FAILED
from coordlib import cfg, membership
from test_job_machine import REC, T0

pytestmark = pytest.mark.timeout(60)


def test_the_limit_follows_the_step_time_with_a_floor_or_is_the_users():
    w = StallWatch()
    w.start(0.0)
    assert w.limit_s() == FLOOR_S and w.overdue(FLOOR_S - 1) is None and "since training started" in w.overdue(FLOOR_S)
    for step in range(30):
        w.committed(step, 100.0 + step * 10, 10.0)  # 10 s steps
    assert w.limit_s() == FACTOR * 10.0
    assert w.overdue(390.0 + FACTOR * 10 - 1) is None
    why = w.overdue(390.0 + FACTOR * 10)
    assert "after step 29" in why and "HINT" in why and "train.stall_timeout_s" in why
    mine = StallWatch(30.0)
    mine.start(0.0)
    mine.committed(0, 5.0, 100.0)  # the user's limit, whatever the steps take
    assert mine.limit_s() == 30.0 and mine.overdue(34.9) is None and mine.overdue(35.0)


def _training(timeout_s):
    m = membership(2, 1, 1)
    job = JobMachine(m, Layout(cfg("task=mlp", "cluster.nodes=2")), 2, Options(300.0, True, 1, REC, timeout_s))
    assert job.advance(T0, Inputs(built=True))[0] == [StartTraining()]
    return job


def test_a_job_that_commits_no_step_is_ended_naming_the_last_step():
    job = _training(60.0)
    job.stall.committed(4, T0 + 10, 1.0)
    assert job.advance(T0 + 69)[0] == [] and job.phase is Phase.TRAINING
    acts, why = job.advance(T0 + 70)
    assert len(acts) == 1 and isinstance(acts[0], Finish) and acts[0].code == EXIT_FAILED and acts[0].status == "stalled"
    assert "after step 4" in acts[0].error and job.phase is Phase.ENDED and "stall" in why


def test_a_recovery_is_not_a_stall_and_restarts_the_clock():
    job = _training(60.0)
    job.stall.committed(4, T0 + 10, 1.0)
    job.phase = Phase.RECOVERING  # while it recovers the recovery's own deadline rules
    job.phase = Phase.TRAINING
    job.stall.start(T0 + 200)  # what a Reformed does
    assert job.advance(T0 + 259)[0] == []
    assert job.advance(T0 + 260)[0][0].status == "stalled"
