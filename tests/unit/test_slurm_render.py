"""Rendering the job shape into sbatch/srun/scontrol text: pure, pinned by golden files.

Regenerate the golden files with ``CKPTLESS_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_slurm_render.py``
and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

import pytest

from ckptless_hpc.slurm import render
from ckptless_hpc.slurm.env import expand_nodelist
from ckptless_hpc.slurm.render import SlurmShape

pytestmark = pytest.mark.timeout(10)

GOLDEN_DIR = Path(__file__).parent / "golden"

FULL_SHAPE = SlurmShape(
    job_name="lm-350m",
    nodes=4,
    spare_nodes=1,
    tasks_per_node=2,
    gpus_per_node=8,
    cpus_per_task=6,
    partition="gpu",
    account="proj42",
    qos="high",
    constraint="h100&ib",
    time_min=240,
    mem_gb=512,
    exclude=["n7", "n3", "n4"],
    signal_delay_s=300,
    additional={"mail-type": "END", "exclusive": True},
    setup=["module load cuda/12.4"],
    output_dir="/scratch/runs",
)

# paths with spaces, both quotes and a semicolon; setup lines are shell code, kept verbatim
STRESS_SHAPE = SlurmShape(
    job_name="it's a \"test\"; job",
    nodes=2,
    output_dir="/scratch/my runs/it's \"q\"; rm -rf x",
    setup=[
        "export DATA_DIR=\"/data/my dir\"; echo 'ready; go'",
        "cd '/work/it'\"'\"'s here' && ls",
    ],
)


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("CKPTLESS_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"golden file {path} is missing. HINT: run with CKPTLESS_UPDATE_GOLDEN=1 once"
    expected = path.read_text()
    assert text == expected, (
        f"rendering differs from {path}.\n--- golden\n{expected}\n--- now\n{text}\n"
        "HINT: if the change is intended, regenerate with CKPTLESS_UPDATE_GOLDEN=1 and review the diff"
    )


def _as_json(value: object) -> str:
    return json.dumps(value, indent=2) + "\n"


# ---- golden -------------------------------------------------------------------------


def test_sbatch_parameters_golden() -> None:
    rendered = {
        "default": render.sbatch_parameters(SlurmShape()),
        "full": render.sbatch_parameters(FULL_SHAPE),
    }
    _check_golden("sbatch_parameters.json", _as_json(rendered))


def test_sbatch_header_golden() -> None:
    _check_golden("sbatch_header_full.txt", "\n".join(render.sbatch_header(FULL_SHAPE)) + "\n")


def test_sbatch_script_quoting_stress_golden() -> None:
    command = ["python", "-m", "ckptless_hpc", "run.dir=/scratch/my runs/it's; x"]
    _check_golden("sbatch_script_stress.sh", render.sbatch_script(STRESS_SHAPE, command))


def test_submitit_script_from_parameters_golden() -> None:
    """What submitit 1.5 writes with our parameters on top of its generic 1x1 shape."""
    from submitit.slurm.slurm import _make_sbatch_string

    script = _make_sbatch_string(
        command="exec /usr/bin/python3 -u -m submitit.core._submit /scratch/sub/%j",
        folder="/scratch/sub/%j",
        job_name="submitit",
        nodes=1,
        ntasks_per_node=1,
        use_srun=False,
        setup=list(FULL_SHAPE.setup),
        additional_parameters=render.sbatch_parameters(FULL_SHAPE),
    )
    flags = [line.split("=")[0] for line in script.splitlines() if line.startswith("#SBATCH")]
    assert len(flags) == len(set(flags)), f"an option appears twice in:\n{script}"
    _check_golden("submitit_script_full.sh", script)


def test_srun_worker_argv_golden() -> None:
    rendered = {
        "minimal": render.srun_worker_argv("n2", 1, ["python", "-m", "worker"], job_id=None, log_path=None),
        "full": render.srun_worker_argv(
            "gpu07",
            8,
            ["python", "-m", "ckptless_hpc.worker", "--rank-base=8"],
            job_id="1234",
            log_path="/scratch/my runs/worker-%s-gpu07.log",
            gpus_per_node=8,
            cpus_per_task=6,
            immediate_s=5,
            extra=["--overlap"],
        ),
    }
    _check_golden("srun_worker_argv.json", _as_json(rendered))


def test_control_argvs_golden() -> None:
    rendered = {
        "down": render.scontrol_down_argv("n3", "ckptless: heartbeat lost at step 120"),
        "requeue": render.scontrol_requeue_argv("1234"),
        "update_job": render.scontrol_update_job_argv("1234", exclude=["n3", "n1", "n2"], num_nodes=3),
        "update_job_start_only": render.scontrol_update_job_argv("1234"),
        "squeue_nodes": render.squeue_nodes_argv("1234"),
        "squeue_state": render.squeue_state_argv("1234"),
        "show_job": render.scontrol_show_job_argv("1234"),
        "signal_batch": render.scancel_signal_argv("1234", "USR2"),
        "signal_full": render.scancel_signal_argv("1234", "SIGTERM", batch_only=False),
    }
    _check_golden("control_argvs.json", _as_json(rendered))


# ---- behaviour ------------------------------------------------------------------------


def test_sbatch_parameters_shape_is_nodes_plus_spares_no_kill_requeue_batch_signal() -> None:
    params = render.sbatch_parameters(SlurmShape(nodes=3, spare_nodes=2, signal_delay_s=90))
    assert params["nodes"] == 5
    assert params["no_kill"] is True and params["requeue"] is True
    assert params["signal"] == "B:USR2@90"
    assert "exclude" not in params and "gpus_per_node" not in params and "mem" not in params


def test_sbatch_header_quotes_values_so_shlex_gets_them_back() -> None:
    header = render.sbatch_header(STRESS_SHAPE)
    values = dict(shlex.split(line[len("#SBATCH ") :])[0].split("=", 1) for line in header if "=" in line)
    assert values["--output"] == "/scratch/my runs/it's \"q\"; rm -rf x/coordinator-%j.out"
    assert values["--job-name"] == "it's a \"test\"; job"


def test_sbatch_script_keeps_setup_verbatim_and_execs_the_command() -> None:
    command = ["python", "-m", "ckptless_hpc", "a b", "it's"]
    script = render.sbatch_script(STRESS_SHAPE, command)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in STRESS_SHAPE.setup:
        assert line in lines
    exec_line = [line for line in lines if line.startswith("exec ")]
    assert len(exec_line) == 1 and shlex.split(exec_line[0])[1:] == command


def test_srun_worker_argv_always_explicit_ntasks_nodelist_immediate() -> None:
    argv = render.srun_worker_argv("n4", 3, ["w"], job_id="77", log_path="/tmp/l.log")
    assert argv[0] == "srun"
    for flag in ("--nodes=1", "--ntasks=3", "--ntasks-per-node=3", "--nodelist=n4", "--immediate=10",
                 "--kill-on-bad-exit=0", "--jobid=77", "--output=/tmp/l.log"):
        assert flag in argv
    assert "--overlap" not in argv
    assert argv[-2:] == ["--", "w"]


def test_shape_is_frozen_and_normalizes_sequences() -> None:
    shape = SlurmShape(exclude=["n1"], setup=["echo hi"], additional={"mail-type": "END"})
    assert shape.exclude == ("n1",) and shape.setup == ("echo hi",)
    with pytest.raises(AttributeError):
        shape.nodes = 3  # type: ignore[misc]
    mine = {"mail-type": "END"}
    assert SlurmShape(additional=mine).additional is not mine
    assert dataclasses.asdict(shape)["exclude"] == ("n1",)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"nodes": 0}, "nodes=0"),
        ({"spare_nodes": -1}, "spare_nodes=-1"),
        ({"tasks_per_node": 0}, "tasks_per_node=0"),
        ({"time_min": 0}, "time_min=0"),
        ({"nodes": True}, "nodes=True"),
        ({"time_min": 2, "signal_delay_s": 120}, "signal_delay_s=120"),
        ({"exclude": ["n[1-2]"]}, "exclude='n[1-2]'"),
        ({"output_dir": "/logs/%j"}, "output_dir='/logs/%j'"),
        ({"setup": ["a\nb"]}, "setup='a\\nb'"),
        ({"job_name": ""}, "job_name=''"),
        ({"additional": {"nodes": "3"}}, "additional['nodes']='3'"),
        ({"additional": {"no-kill": True}}, "additional['no-kill']=True"),
        ({"additional": {"--mail-type": "END"}}, "additional='--mail-type'"),
        ({"additional": {"mail-type": 3}}, "additional['mail-type']=3"),
    ],
)
def test_shape_errors_name_field_value_and_hint(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as info:
        SlurmShape(**kwargs)
    message = str(info.value)
    assert field in message and "HINT" in message


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: render.srun_worker_argv("n[1-2]", 1, ["w"], job_id=None, log_path=None), "node='n[1-2]'"),
        (lambda: render.srun_worker_argv("n1", 0, ["w"], job_id=None, log_path=None), "ntasks=0"),
        (lambda: render.srun_worker_argv("n1", 1, [], job_id=None, log_path=None), "command=[]"),
        (lambda: render.srun_worker_argv("n1", 1, ["w"], job_id="12 3", log_path=None), "job_id='12 3'"),
        (lambda: render.scontrol_down_argv("n1", " "), "reason=' '"),
        (lambda: render.scontrol_update_job_argv("1", start_in_s=0), "start_in_s=0"),
        (lambda: render.scontrol_update_job_argv("1", start_in_s=None), "update='nothing'"),
        (lambda: render.scontrol_requeue_argv("abc"), "job_id='abc'"),
        (lambda: render.scancel_signal_argv("1", "USR2; rm"), "signal='USR2; rm'"),
    ],
)
def test_argv_errors_name_field_value_and_hint(call, field: str) -> None:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert field in message and "HINT" in message


def test_job_states_in_one_squeue_call() -> None:
    assert render.squeue_states_argv(["12", "13"]) == ["squeue", "--noheader", "--jobs=12,13", "--format=%i %T"]
    assert render.parse_squeue_states("12 RUNNING\n13_4 PENDING\n\n") == {"12": "RUNNING", "13": "PENDING"}
    assert render.scancel_argv("12") == ["scancel", "12"]
    with pytest.raises(ValueError):
        render.squeue_states_argv(["12; rm -rf /"])


def test_requeue_excluding_runs_both_commands_in_one_sigterm_proof_shell() -> None:
    argv = render.requeue_excluding_argv("1234", ["n3", "n1"])
    assert argv[:2] == ["sh", "-c"] and 'trap "" TERM' in argv[2]
    assert argv[4:] == ["1234", "scontrol", "update", "jobid=1234", "ExcNodeList=n[1,3]"]
    assert render.requeue_excluding_argv("1234") == render.scontrol_requeue_argv("1234")  # nothing to exclude


def test_submitit_requeues_through_the_method_the_job_replaces() -> None:
    """launch/slurm.py has submitit's own requeue set the exclusions too, through this method."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    assert callable(getattr(SlurmJobEnvironment, "_requeue", None))


def test_companion_job_has_the_jobs_shape_per_node_never_requeues_and_ends_with_the_job() -> None:
    """cluster.grow=job: the companion's sbatch argv (no shell: values unquoted)."""
    argv = render.companion_sbatch_argv(FULL_SHAPE, "4242", 2, exclude=["n1", "n2"], output="/scratch/runs/logs/grow-%j.out")
    _check_golden("companion_sbatch_argv.json", _as_json(argv))
    flags = dict(a.split("=", 1) if "=" in a else (a, True) for a in argv[1:])
    assert flags["--nodes"] == "2" and flags["--job-name"] == "lm-350m-grow-4242" and flags["--parsable"] is True
    assert flags["--partition"] == "gpu" and flags["--gpus-per-node"] == "8" and flags["--exclusive"] is True  # the job's shape, per node
    assert "--requeue" not in flags and "--signal" not in flags  # the main job's coordinator owns the run
    assert expand_nodelist(flags["--exclude"]) == ["n1", "n2", "n3", "n4", "n7"]  # the job's nodes and its site exclusions
    assert "--jobs=4242" in flags["--wrap"] and "RUNNING" in flags["--wrap"]  # it holds its nodes only while the main job runs
    with pytest.raises(ValueError, match="nodes"):
        render.companion_sbatch_argv(FULL_SHAPE, "4242", 0)


def test_the_allocation_gives_each_node_a_task_per_worker() -> None:
    """cluster.workers_per_node=2: each node's worker step is ``srun --ntasks=2``, which Slurm
    refuses ("More processors requested than permitted") in an allocation of one task per node."""
    from hydra import compose, initialize_config_module

    from ckptless_hpc.config import register_configs
    from ckptless_hpc.launch.slurm import shape_from_config

    register_configs()
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["cluster=slurm", "cluster.workers_per_node=2", "cluster.nodes=2"])
    shape = shape_from_config(cfg, "/scratch/run")
    assert shape.tasks_per_node == 2 and render.sbatch_parameters(shape)["ntasks_per_node"] == 2
