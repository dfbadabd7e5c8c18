"""Bad input fails before anything starts, naming the field and a hint."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    "override, field",
    [
        ("cluster.nodes=0", "cluster.nodes"),
        ("cluster.spare_nodes=-1", "cluster.spare_nodes"),
    ],
)
def test_bad_values_fail_before_start(job, override, field):
    res = job(override, "train.steps=5")
    assert res.rc == 2
    assert field in res.out and "HINT" in res.out
    assert not (res.run_dir / "events.jsonl").exists(), "something started"


def test_fault_rank_out_of_range(job):
    res = job("fault=kill_worker", "fault.rank=7")
    assert res.rc == 2 and "fault.rank=7" in res.out and "rank=0..1" in res.out


def test_unknown_task_unknown_key_and_wrong_type_exit_2(job):
    """Refused while Hydra composes the config: exit 2 as for any invalid configuration
    (docs/failure-semantics.md), the field named, with a HINT."""
    res = job("task=nosuch")
    assert res.rc == 2 and "task" in res.out and "mlp" in res.out, res.out  # Hydra lists the available options
    res = job("train.stpes=3")
    assert res.rc == 2 and "invalid configuration: train.stpes: Key 'stpes' not in 'TrainConfig'. HINT:" in res.out, res.out
    res = job("train.steps=abc")
    assert res.rc == 2 and "invalid configuration: train.steps: Value 'abc' of type 'str' could not be converted to Integer. HINT:" in res.out, res.out
    assert not (res.run_dir / "events.jsonl").exists(), "something started"


def test_slurm_backend_without_a_reachable_slurm(job):
    res = job("cluster=slurm", "task=mlp", env={"SLURM_CONF": "/nonexistent/slurm.conf"})
    assert res.rc == 2, res.out
    assert "cluster=slurm but no Slurm is reachable" in res.out and "HINT" in res.out
    assert not (res.run_dir / "job.json").exists()
