"""survivors_restarted is measured from outside the control connection: the launcher's own
record of every worker process (pid and start time, /proc) at launch against the survivors'
after the recovery. A survivor is the very process launched for it."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MLP3 = ("task=mlp", "train.steps=60", "cluster.nodes=3")


def test_survivors_are_the_processes_launched_for_them(job, baseline):
    res = job(*MLP3, "fault=kill_worker", "fault.rank=1", "fault.step=20")
    assert res.rc == 0, res.out
    (rec,) = res.summary["recoveries"]
    assert rec["survivors_checked"] == 2 and rec["survivors_restarted"] == 0, rec
    assert res.summary["final_state_sha256"] == baseline(*MLP3)
    launched = {w: tuple(i) for e in res.of("node_started") for w, i in e["identities"].items()}
    (reformed,) = res.of("reformed")
    survivors = {w: tuple(i) for w, i in reformed["survivors"].items()}
    assert sorted(survivors) == ["local0.0", "local2.0"]
    for w, identity in survivors.items():  # same pid, same start time as at launch
        assert identity == launched[w], (w, identity, launched[w])
    said = {e["worker"]: e["pid"] for e in res.of("worker_connected")}  # what the workers said, inside
    assert all(said[w] == survivors[w][0] for w in survivors)
    assert not res.of("survivor_restarted")
