"""SlurmEnvironment and node-list expansion: pure, dicts in, values out."""

from __future__ import annotations

import pytest

from ckptless_hpc.slurm.env import SlurmEnvironment, compress_nodelist, expand_nodelist

pytestmark = pytest.mark.timeout(10)

BATCH_ENV = {
    "SLURM_JOB_ID": "1234",
    "SLURM_RESTART_COUNT": "2",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_NODELIST": "n[1-3],gpu01",
    "SLURM_NTASKS": "4",
    "SLURM_SUBMIT_DIR": "/home/me/run",
}


def test_environment_reads_batch_variables() -> None:
    env = SlurmEnvironment(BATCH_ENV)
    assert env.in_job
    assert env.job_id == "1234"
    assert env.require_job_id() == "1234"
    assert env.restart_count == 2
    assert env.nodename == "n1"
    assert env.job_nodelist == "n[1-3],gpu01"
    assert env.job_nodes == ["n1", "n2", "n3", "gpu01"]
    assert env.ntasks == 4
    assert env.submit_dir == "/home/me/run"
    assert env.step_id is None
    assert env.procid is None


def test_environment_step_variables_and_old_names() -> None:
    env = SlurmEnvironment({"SLURM_JOBID": "7", "SLURM_STEP_ID": "3", "SLURM_PROCID": "5", "SLURM_NODELIST": "n4"})
    assert env.job_id == "7"
    assert env.step_id == 3
    assert env.procid == 5
    assert env.job_nodes == ["n4"]


def test_environment_outside_slurm() -> None:
    env = SlurmEnvironment({"HOME": "/root"})
    assert not env.in_job
    assert env.job_id is None
    assert env.restart_count == 0
    assert env.job_nodes == []
    with pytest.raises(ValueError, match="HINT"):
        env.require_job_id()


def test_a_worker_of_a_companion_job_serves_the_job_that_started_it() -> None:
    """cluster.grow=job: its last resort saves and requeues the job it joined, never its own."""
    env = SlurmEnvironment({**BATCH_ENV, "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0", "CKPTLESS_SLURM_JOB_ID": "1234", "CKPTLESS_SLURM_RESTART_COUNT": "2"})
    assert env.job_id == env.require_job_id() == "1234" and env.restart_count == 2


def test_environment_restart_count_unset_or_empty_is_zero() -> None:
    assert SlurmEnvironment({"SLURM_JOB_ID": "1"}).restart_count == 0
    assert SlurmEnvironment({"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": ""}).restart_count == 0


def test_environment_is_a_snapshot() -> None:
    source = {"SLURM_JOB_ID": "1"}
    env = SlurmEnvironment(source)
    source["SLURM_JOB_ID"] = "2"
    assert env.job_id == "1"


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_environment_bad_integer_names_variable_value_and_hint(value: str) -> None:
    env = SlurmEnvironment({"SLURM_RESTART_COUNT": value})
    with pytest.raises(ValueError) as info:
        _ = env.restart_count
    message = str(info.value)
    assert "SLURM_RESTART_COUNT" in message and repr(value) in message and "HINT" in message


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("", []),
        ("n1", ["n1"]),
        ("n[1-3,5],gpu[01-02]", ["n1", "n2", "n3", "n5", "gpu01", "gpu02"]),
        ("n[09-11]", ["n09", "n10", "n11"]),
        ("n[001-003],n010", ["n001", "n002", "n003", "n010"]),
        ("rack[1-2]-n[09-10]", ["rack1-n09", "rack1-n10", "rack2-n09", "rack2-n10"]),
        ("a[1-2]b[3-4]c", ["a1b3c", "a1b4c", "a2b3c", "a2b4c"]),
        ("n3,n1", ["n3", "n1"]),
        ("x1,x01", ["x1", "x01"]),
        ("node-a.b_c", ["node-a.b_c"]),
    ],
)
def test_expand_nodelist(nodelist: str, expected: list[str]) -> None:
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    ("nodelist", "what"),
    [
        ("n[1-3", "never closed"),
        ("n1-3]", "without '['"),
        ("n[[1]]", "nested"),
        ("n[3-1]", "downwards"),
        ("n[a-b]", "bad range"),
        ("n[]", "bad range"),
        ("n 1", "bad node name"),
        ("n[1]$x", "bad node name"),
    ],
)
def test_expand_nodelist_errors_say_what_value_and_hint(nodelist: str, what: str) -> None:
    with pytest.raises(ValueError) as info:
        expand_nodelist(nodelist)
    message = str(info.value)
    assert what in message and repr(nodelist) in message and "HINT" in message


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ([], ""),
        (["n2"], "n2"),
        (["n1", "n2", "n3", "n5"], "n[1-3,5]"),
        (["n3", "n1", "n2", "n2"], "n[1-3]"),
        (["gpu01", "gpu02", "gpu10", "gpu12", "n9", "n10", "login"], "gpu[01-02,10,12],login,n[9-10]"),
        ([f"n{i}" for i in range(1, 1001)], "n[1-1000]"),
        (["x1", "x01"], "x01,x1"),
    ],
)
def test_compress_nodelist(names: list[str], expected: str) -> None:
    assert compress_nodelist(names) == expected


@pytest.mark.parametrize(
    "names",
    [
        ["n1", "n2", "n3", "n5"],
        ["gpu01", "gpu02", "gpu10", "n9", "n10", "n01", "login", "rack1-n3"],
        ["a0", "a00", "a000", "a1", "a10", "a010"],
    ],
)
def test_compress_then_expand_round_trips(names: list[str]) -> None:
    assert sorted(expand_nodelist(compress_nodelist(names))) == sorted(set(names))


def test_compress_rejects_a_nodelist_in_place_of_a_name() -> None:
    with pytest.raises(ValueError, match=r"'n\[1-2\]'.*HINT"):
        compress_nodelist(["n[1-2]"])
