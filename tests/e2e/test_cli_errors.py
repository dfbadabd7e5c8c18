"""Bad input fails before anything starts, naming the field and a hint."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


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


PLAIN = "examples.plain_loop.RegressionTask"


@pytest.mark.parametrize(
    "overrides, wanted",
    [
        # the wrong override form: task._target_= keeps the default group's (lm's) arguments
        ((f"task._target_={PLAIN}",), ("task.d_model=128", "takes no such arguments", f"HINT: an override task._target_=... keeps", f"~task +task._target_=")),
        (("task._target_=examples.nope.Task",), ("task._target_='examples.nope.Task'", "cannot be imported", "HINT")),
        (("task._target_=examples.plain_loop.RegresionTask",), ("has no 'RegresionTask'", "HINT: check the class name; did you mean RegressionTask?")),
        (("~task", f"+task._target_={PLAIN}", "+task.batch_sise=3"), ("task.batch_sise=3", "takes no argument 'batch_sise'", "HINT: did you mean task.batch_size?")),
        (("~task", "+task._target_=engine_tasks.NeverBuilt"), ("task.width is missing", "HINT: +task.width=<value>")),
    ],
)
def test_dry_run_checks_the_task(job, overrides, wanted):
    """The task's class is imported and the arguments matched against its signature: refused with
    exit 2, field, value and HINT, and nothing launched (a dry run launches nothing anyway)."""
    res = job("dry_run=true", *overrides, env={"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")})
    assert res.rc == 2, res.out
    for w in wanted:
        assert w in res.out, (w, res.out)
    assert "configuration valid" not in res.out


def test_dry_run_accepts_a_task_without_building_it_and_shows_the_global_batch(job):
    tasks = {"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")}
    res = job("dry_run=true", "~task", "+task._target_=engine_tasks.NeverBuilt", "+task.width=3", "train.grad_accum=3", env=tasks)
    assert res.rc == 0, res.out
    assert "configuration valid" in res.out and "NeverBuilt was constructed" not in res.out
    assert "global batch: batch_size 16 x grad_accum 3 x world 2 = 96 samples per step" in res.out  # MLPTask's default, through **kw
    res = job("dry_run=true", "~task", f"+task._target_={PLAIN}", "+task.batch_size=8", "cluster.nodes=3")
    assert res.rc == 0 and "global batch: batch_size 8 x grad_accum 1 x world 3 = 24 samples per step" in res.out, res.out
