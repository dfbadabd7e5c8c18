"""The Slurm chaos driver's pure parts: drawing schedules, naming targets, judging effects."""

from __future__ import annotations

import random

import pytest

from ckptless_hpc.chaos.local import parse_args
from ckptless_hpc.chaos.slurm import KILL_SLURMD_BY_STEP, KINDS, LOSSES, fired, outcome, parse_kinds, random_schedule, resolve

pytestmark = pytest.mark.timeout(10)


def test_schedules_lose_at_most_one_node_and_are_reproducible():
    assert random_schedule(random.Random(4), 1500, KINDS) == random_schedule(random.Random(4), 1500, KINDS)
    rng = random.Random(0)
    seen = set()
    for _ in range(500):
        faults = random_schedule(rng, 1500, KINDS)
        assert 1 <= len(faults) <= 3
        assert sum(f["kind"] in LOSSES for f in faults) <= 1  # a requeue after two losses pends forever on 4 nodes
        assert [f["step"] for f in faults] == sorted(f["step"] for f in faults)
        assert all(30 <= f["step"] < 1125 for f in faults)
        for f in faults:
            seen.add((f["kind"], f.get("target")))
            if f["kind"] == "kill_slurmd":
                assert f["step"] <= KILL_SLURMD_BY_STEP
            assert ("target" in f) == (f["kind"] in ("crash_node", "kill_slurmd", "cancel_step"))
    assert {k for k, _ in seen} == set(KINDS) and ("crash_node", "spare") in seen and ("cancel_step", "worker") in seen


def test_kinds_restrict_the_draw():
    rng = random.Random(1)
    for _ in range(100):
        assert {f["kind"] for f in random_schedule(rng, 400, ["preempt"])} == {"preempt"}
        assert {f["kind"] for f in random_schedule(rng, 400, ["cancel_step"])} == {"cancel_step"}
    with pytest.raises(ValueError, match="kinds='crash,preempt'.*crash"):
        parse_kinds("crash,preempt")


def _ev(event, t, **kw):
    return {"event": event, "time": t, **kw}


EVENTS = [
    _ev("job_started", 1.0), _ev("node_started", 1.1, node="n1", role="active"), _ev("node_started", 1.2, node="n2", role="active"),
    _ev("node_started", 1.3, node="n3", role="spare"), _ev("worker_connected", 1.4, node="n2", slurm_step=1),
    _ev("generation_started", 2.0, ranks={"0": "n1.0", "1": "n2.0"}), _ev("step", 3.0, step=40),
]


def test_targets_are_named_from_the_current_attempt():
    assert resolve({"kind": "crash_node", "target": "worker", "step": 30}, EVENTS, "n1") == "n2"  # not the batch host
    assert resolve({"kind": "cancel_step", "target": "spare", "step": 30}, EVENTS, "n1") == "n3"
    assert resolve({"kind": "lost_batch_host", "step": 30}, EVENTS, "n1") == "n1"
    used = EVENTS + [_ev("spare_promoted", 4.0, node="n3", rank=1), _ev("reformed", 4.1, ranks={"0": "n1.0", "1": "n3.0"})]
    assert resolve({"kind": "crash_node", "target": "spare", "step": 30}, used, "n1") is None  # the spare was used: nothing to hit
    assert resolve({"kind": "crash_node", "target": "worker", "step": 30}, used, "n1") == "n3"


def test_a_fault_fires_only_with_its_effect():
    inj = {"time": 5.0, "attempts": 1, "node": "n2"}
    crash = {"kind": "crash_node", "target": "worker", "step": 30}
    assert fired(crash, inj, EVENTS) is None
    assert fired(crash, inj, EVENTS + [_ev("failure_detected", 4.0, node="n2")]) is None  # before the injection: another cause
    assert fired(crash, inj, EVENTS + [_ev("failure_detected", 6.0, node="n3")]) is None
    assert fired(crash, inj, EVENTS + [_ev("failure_detected", 6.0, node="n2")])["node"] == "n2"
    pre = {"kind": "preempt", "step": 30}
    save = _ev("emergency_save", 6.0, reason="Slurm warning signal (time limit or preemption)", saved={"step": 40})
    restart = [_ev("job_started", 20.0), _ev("generation_started", 21.0, ranks={"0": "n2.0", "1": "n3.0"})]
    assert fired(pre, inj, EVENTS + [save]) is None  # saved, but never restarted
    assert fired(pre, inj, EVENTS + [save] + restart)["event"] == "generation_started"
    nosave = dict(save, saved=None)
    assert fired(pre, inj, EVENTS + [nosave] + restart) is None
    lost = {"kind": "lost_batch_host", "step": 30}
    inj1 = dict(inj, node="n1")
    assert fired(lost, inj1, EVENTS + restart)["event"] == "generation_started"
    assert fired(lost, inj1, EVENTS + [restart[0], _ev("generation_started", 21.0, ranks={"0": "n1.0", "1": "n3.0"})]) is None  # the lost host used again


def test_outcome_counts_attempts_and_recoveries():
    evs = EVENTS + [_ev("reformed", 4.0, ranks={}), _ev("job_finished", 5.0, status="requeued"), _ev("job_started", 20.0), _ev("job_finished", 30.0, status="completed")]
    res = outcome(evs, {"status": "completed", "exit_code": 0, "final_state_sha256": "ab"})
    assert res["requeues"] == 1 and res["recoveries"] == 1 and res["ended_attempts"] == ["requeued", "completed"]
    assert outcome(evs[:-1], None)["ended_attempts"][-1] == "no summary (coordinator lost)"


def test_slurm_arguments():
    opts = parse_args(["cluster=slurm", "runs=2"])
    assert opts["task"] == "lm" and opts["steps"] == 1500 and opts["nodes"] == 2 and opts["runs"] == 2
    assert parse_args(["cluster=slurm", "steps=400"])["steps"] == 400  # given beats the backend's default
    with pytest.raises(ValueError, match="nodes=3.*HINT"):
        parse_args(["cluster=slurm", "nodes=3"])
    with pytest.raises(ValueError, match="cluster='pbs'"):
        parse_args(["cluster=pbs"])
    with pytest.raises(ValueError, match="kinds=.*cluster=slurm"):
        parse_args(["kinds=preempt"])
    assert parse_args([])["task"] == "mlp"  # the local soak keeps its defaults
