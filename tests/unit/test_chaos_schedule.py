from __future__ import annotations

import random

import pytest

from ckptless_hpc.chaos.local import parse_args, random_schedule, run_verdict, schedule_override

pytestmark = pytest.mark.timeout(10)


def test_schedules_are_reproducible_and_always_hold_a_step_kill():
    a = [random_schedule(random.Random(3), 60, 3, 1) for _ in range(1)]
    b = [random_schedule(random.Random(3), 60, 3, 1) for _ in range(1)]
    assert a == b
    rng = random.Random(0)
    for _ in range(200):
        faults = random_schedule(rng, 60, 3, 2)
        assert 1 <= len(faults) <= 4
        assert any(f["kind"] in ("kill_worker", "kill_node", "hang") and f.get("at", "step") in ("step", "update") for f in faults)
        for f in faults:
            assert 0 < f["step"] < 60
            assert f.get("rank", 0) < 6 and f.get("node", 0) < 3


def test_override_is_hydra_list_syntax():
    assert schedule_override([{"kind": "hang", "rank": 1, "step": 5}]) == "fault.schedule=[{kind:hang,rank:1,step:5}]"


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="runz"):
        parse_args(["runz=3"])
    with pytest.raises(ValueError, match="runs='x'"):
        parse_args(["runs=x"])


def test_the_local_verdict_counts_the_faults_the_run_fired_not_the_plan():
    """Fired is read from the run's summary (the coordinator's record of the workers' reports):
    a schedule with a fault that never fired is UNFIRED (and re-drawn), not ok."""
    good = {"final_state_sha256": "abc", "faults_fired": [0, 1, 2]}
    assert run_verdict(3, 0, good, "abc") == ("ok", True, 3)
    assert run_verdict(3, 0, {**good, "faults_fired": [0, 2]}, "abc") == ("UNFIRED", True, 2)
    assert run_verdict(2, 0, {**good, "faults_fired": []}, "abc") == ("UNFIRED", True, 0)
    assert run_verdict(2, 0, {**good, "faults_fired": [0, 5]}, "abc") == ("UNFIRED", True, 1)  # an index not in the plan is no planned fault
    assert run_verdict(3, 0, {**good, "final_state_sha256": "abd"}, "abc") == ("FAIL", False, 3)  # the oracle broke
    assert run_verdict(3, 1, good, "abc") == ("FAIL", False, 3)  # the job failed
    assert run_verdict(3, -1, None, "abc") == ("FAIL", False, 0)  # no summary (a timeout): nothing is known to have fired


def test_a_run_reads_its_summary_or_none(tmp_path, monkeypatch):
    """_run's verdict input: the run's summary.json (rundir/summary.py), None when it wrote none or a broken one."""
    import subprocess
    import types

    from ckptless_hpc.chaos import local

    monkeypatch.setattr(local.subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(returncode=3))
    assert local._run(str(tmp_path), [], 5) == (3, None)
    (tmp_path / "summary.json").write_text('{"status": "completed"}')
    assert local._run(str(tmp_path), [], 5) == (3, {"status": "completed"})
    (tmp_path / "summary.json").write_text('{"status": ')
    assert local._run(str(tmp_path), [], 5) == (3, None)

    def hang(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, 5)

    monkeypatch.setattr(local.subprocess, "run", hang)
    assert local._run(str(tmp_path / "nothing"), [], 5) == (-1, None)


def test_elastic_schedules_lose_at_most_nodes_minus_one_and_never_kill_a_spare():
    from ckptless_hpc.chaos.local import ELASTIC_KINDS, LOSSES

    rng = random.Random(9)
    for _ in range(300):
        faults = random_schedule(rng, 60, 3, 1, max_losses=2, kinds=ELASTIC_KINDS)
        assert 1 <= sum(f["kind"] in LOSSES for f in faults) <= 2, faults  # a loss to shrink on, never the last node
        assert all(f["kind"] != "kill_spare" for f in faults)
    assert "only ddp and zero shrink" in str(pytest.raises(ValueError, parse_args, ["elastic=1", "parallel=fsdp"]).value)
