"""ckptless_hpc.slurm against the real Slurm test cluster (tests/slurm_cluster/up.sh).

Skipped without root; with CKPTLESS_REQUIRE_SLURM=1 a missing cluster fails instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ckpt_testlib import wait_for

from ckptless_hpc.slurm import commands, render
from ckptless_hpc.slurm.env import expand_nodelist
from ckptless_hpc.slurm.render import SlurmShape

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


@pytest.fixture
def submit(slurm_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., str]]:
    """sbatch with the given args, run in tmp_path; every job is cancelled at teardown."""
    job_ids: list[str] = []

    def _submit(*args: str, script: str | None = None) -> str:
        argv = ["sbatch", "--parsable", f"--chdir={tmp_path}", *args]
        done = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=20, check=True)
        job_ids.append(done.stdout.strip().split(";")[0])
        return job_ids[-1]

    yield _submit
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=20, check=False)




def _node_state(node: str) -> str:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10).stdout
    return dict(line.split() for line in out.splitlines()).get(node, "")


def _running(job_id: str, within_s: float = 30) -> None:
    wait_for(f"job {job_id} RUNNING", lambda: commands.job_state(job_id) == "RUNNING", within_s)


def _step_running(job_id: str, step: str = "0") -> None:
    def listed() -> bool:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], capture_output=True, text=True,
                             timeout=10).stdout
        return f"{job_id}.{step}" in out.split()
    wait_for(f"step {job_id}.{step}", listed, 30)


def _idle(node: str) -> None:
    wait_for(f"{node} idle", lambda: _node_state(node) == "idle", 60)


# ---- tests ------------------------------------------------------------------------------


def test_slurm_available(slurm_env: dict[str, str], tmp_path: Path) -> None:
    ok, reason = commands.slurm_available()
    assert ok, reason
    assert "UP" in reason
    wrong = tmp_path / "slurm.conf"
    text = Path(slurm_env["SLURM_CONF"]).read_text()
    wrong.write_text(re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=1", text))  # nobody listens there
    ok, reason = commands.slurm_available(env={"SLURM_CONF": str(wrong)})
    assert not ok and "scontrol ping" in reason


def test_live_nodes_job_state_and_worker_step(submit: Callable[..., str], tmp_path: Path) -> None:
    job = submit("-N2", "--ntasks-per-node=2", "--no-kill", "--wrap", "sleep 60")
    _running(job)
    nodes = commands.live_nodes(job)
    assert len(nodes) == 2 and all(node.startswith("n") for node in nodes)
    # a worker step from outside the batch script: explicit ntasks, node, job id
    log = tmp_path / "worker on it's node.log"
    argv = render.srun_worker_argv(nodes[1], 2, ["printenv", "SLURMD_NODENAME"], job_id=job,
                                   log_path=str(log), extra=["--overlap"])
    subprocess.run(argv, timeout=60, check=True)
    assert log.read_text().split() == [nodes[1], nodes[1]]
    subprocess.run(["scancel", job], timeout=20, check=True)
    wait_for("job to end", lambda: commands.job_state(job) in ("CANCELLED", "COMPLETED"), 30)
    assert commands.live_nodes(job) == []  # squeue no longer lists it
    assert commands.job_state("999999") is None


def test_down_node_ends_its_step_and_removes_it_from_the_job(submit: Callable[..., str], tmp_path: Path) -> None:
    job = submit("-N2", "--no-kill", "--wrap", "sleep 100")
    _running(job)
    keep, lost = commands.live_nodes(job)
    step = subprocess.Popen(render.srun_worker_argv(lost, 1, ["sleep", "100"], job_id=job,
                                                    log_path=str(tmp_path / "w.log"), extra=["--overlap"]))
    try:
        _step_running(job)
        commands.down_node(lost, "ckptless test: heartbeat lost")
        step.wait(timeout=30)  # the step on the downed node ends at once
        assert commands.live_nodes(job) == [keep]
        assert commands.job_state(job) == "RUNNING"  # --no-kill: the job lives on
    finally:
        step.kill()
        step.wait()
    _idle(lost)  # ReturnToService=2: back to idle, but never back into the job
    assert commands.live_nodes(job) == [keep]


def test_crashed_node_leaves_the_job_and_srun_exits_0(submit: Callable[..., str], tmp_path: Path, slurm_cluster) -> None:
    job = submit("-N2", "--no-kill", "--wrap", "sleep 110")
    _running(job)
    keep, lost = commands.live_nodes(job)
    step = subprocess.Popen(render.srun_worker_argv(lost, 1, ["sleep", "110"], job_id=job,
                                                    log_path=str(tmp_path / "w.log"), extra=["--overlap"]),
                            stderr=subprocess.PIPE, text=True)
    try:
        _step_running(job)
        slurm_cluster.crash_node(lost)
        # Slurm needs ~15-20 s to mark a crashed node DOWN; then the step's srun exits 0
        _, stderr = step.communicate(timeout=60)
        assert step.returncode == 0, stderr  # gotcha: srun exit code does not show a lost node
        # what srun says depends on which it sees first: slurmctld's node failure, or its I/O
        # connection to the dead slurmstepd reset (then the step times out); exit 0 either way
        assert f"Node failure on {lost}" in stderr or ("Connection reset by peer" in stderr and "Timed out waiting for job step" in stderr), stderr
        assert commands.live_nodes(job) == [keep]
    finally:
        if step.poll() is None:
            step.kill()
            step.wait()
        slurm_cluster.start_node(lost)
    _idle(lost)


def test_requeue_then_update_pending_job_excludes_a_node(submit: Callable[..., str], tmp_path: Path) -> None:
    out = tmp_path / "restarts.txt"
    script = f'#!/bin/bash\necho "$SLURM_RESTART_COUNT $SLURM_JOB_NODELIST" >> "{out}"\nsleep 100\n'
    job = submit("-N2", "--no-kill", "--requeue", "-o", str(tmp_path / "job.out"), script=script)
    _running(job)
    first = commands.live_nodes(job)
    commands.requeue(job)
    commands.update_pending_job(job, exclude=[first[0]], num_nodes=2, start_in_s=2)
    wait_for("the restarted batch script", lambda: out.exists() and len(out.read_text().splitlines()) >= 2, 60)
    restart, nodelist = out.read_text().splitlines()[1].split()
    assert restart == "1"
    assert first[0] not in commands.live_nodes(job)
    assert first[0] not in expand_nodelist(nodelist)


def test_rendered_script_with_hostile_paths_runs_and_gets_the_signal(submit: Callable[..., str],
                                                                     tmp_path: Path) -> None:
    out_dir = tmp_path / "my runs" / "it's \"q\"; x"
    out_dir.mkdir(parents=True)
    flag = tmp_path / "got USR2"
    shape = SlurmShape(job_name="it's a \"test\"; job", nodes=1, time_min=5, output_dir=str(out_dir),
                       setup=["echo \"setup ran; nodes=$SLURM_JOB_NUM_NODES\" 'quoted; ok'"])
    python = (
        "import pathlib, signal, sys, time\n"
        "flag = pathlib.Path(sys.argv[1])\n"
        "signal.signal(signal.SIGUSR2, lambda *a: flag.write_text('USR2'))\n"
        "print('coordinator up', flush=True)\n"
        "end = time.time() + 60\n"
        "while not flag.exists() and time.time() < end: time.sleep(0.05)\n"
    )
    job = submit(script=render.sbatch_script(shape, [sys.executable, "-c", python, str(flag)]))
    _running(job)
    log = out_dir / f"coordinator-{job}.out"
    wait_for("the coordinator's first line", lambda: log.exists() and "coordinator up" in log.read_text(), 30)
    subprocess.run(render.scancel_signal_argv(job, "USR2"), timeout=20, check=True)
    wait_for("USR2 at the batch-resident python", flag.exists, 30)
    text = log.read_text()
    assert "setup ran; nodes=1 quoted; ok" in text
    show = subprocess.run(render.scontrol_show_job_argv(job), capture_output=True, text=True, timeout=10).stdout
    assert commands.parse_job_field(show, "Requeue") == "1"
