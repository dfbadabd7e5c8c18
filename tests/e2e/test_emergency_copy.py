"""The emergency copy says what it holds, survives storage faults, and is never loaded damaged:
real jobs, real files, a real full filesystem (a tmpfs mounted over the run's state dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckpt_testlib import REPO, JobResult, fill_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MLP = ("task=mlp", "train.steps=60")
NO_SPARE = (*MLP, "cluster.spare_nodes=0", "cluster.max_refills=0", "fault=kill_worker", "fault.rank=1", "fault.step=20")
DRIVER = REPO / "tests" / "e2e" / "drivers" / "resume_local.py"


def test_a_spare_without_state_is_never_saved_as_the_jobs_state(job):
    """Rank 1 dies, its spare is promoted, then rank 0 dies while sending it the state: the only
    worker left holds a freshly built model. Nothing trained survived, and the job says so."""
    res = job(*MLP, "cluster.max_refills=0", "fault=kill_worker", "fault.rank=1", "fault.step=20", "fault.schedule=[{kind:kill_worker,rank:0,at:send,step:0}]")
    assert res.rc == 3, res.out
    s = res.summary
    assert s["faults_fired"] == [0, 1] and res.of("spare_promoted")
    assert s["saved_state"] is None and not (res.run_dir / "state" / "emergency.pt").exists()
    assert "nothing trained survived" in s["error"] and "State of step" not in s["error"], s["error"]


@pytest.fixture
def full_state_dir(tmp_path):
    """A 64 KiB tmpfs mounted over the first run's state dir, filled up: ENOSPC for real."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "run0" / "state"
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        fill_up(path)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20)


def test_full_disk_is_a_clear_error_and_leaves_no_bad_copy(job, full_state_dir):
    state = full_state_dir
    res = job(*NO_SPARE)
    assert res.rc == 3, res.out
    s = res.summary
    path = str(state / "emergency.pt")
    assert s["saved_state"] is None and "No state could be saved" in s["error"]
    assert path in s["error"] and "no space left" in s["error"] and "HINT" in s["error"], s["error"]
    assert sorted(os.listdir(state)) == ["filler"]  # no copy, no temporary file
    (failed,) = res.of("save_failed")
    assert failed["path"] == path


def _resume(run_dir, restart: str, *overrides: str) -> JobResult:
    cmd = [sys.executable, str(DRIVER), restart, f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    return JobResult(p.returncode, p.stdout + p.stderr, run_dir)


@pytest.mark.parametrize("damage", ["none", "truncated", "altered"])
def test_a_requeued_job_refuses_a_damaged_copy(job, tmp_path, baseline, damage):
    first = job(*NO_SPARE)
    assert first.rc == 3, first.out
    saved = first.summary["saved_state"]
    restart = first.run_dir / "restart.json"
    assert json.loads(restart.read_text())["saved"]["sha256"] == saved["sha256"]
    if damage == "truncated":
        os.truncate(saved["path"], saved["bytes"] // 2)
    elif damage == "altered":
        with open(saved["path"], "r+b") as f:
            data = bytearray(f.read())
            at = len(data) // 2
            data[at : at + 64] = bytes(b ^ 0x5A for b in data[at : at + 64])
            f.seek(0)
            f.write(data)
    res = _resume(tmp_path / "resumed", str(restart), *MLP, "cluster.nodes=2")
    if damage == "none":  # the control: an intact copy is loaded and the job ends with the oracle
        assert res.rc == 0, res.out
        assert res.summary["resumed_from"]["step"] == saved["step"] and res.summary["final_state_sha256"] == baseline(*MLP)
        return
    assert res.rc == 1, res.out
    s = res.summary
    assert s["status"] == "failed" and "cannot resume" in s["error"] and saved["path"] in s["error"] and "HINT" in s["error"], s["error"]
    assert not res.of("step"), "trained on a damaged copy"
    assert res.of("load_failed")
