"""``ckptless-hpc status|logs|cancel|report`` on real local runs, through the real entry point.

A finished run (a worker killed, so rank 1 changes hands) is made once per module; a second,
long run is started, inspected while it trains, and cancelled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ckpt_testlib import REPO, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MLP = ("task=mlp", "cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")


def tool(*args: str, timeout_s: float = 60):
    """Run ``python -m ckptless_hpc <tool> ...`` (what the ckptless-hpc script runs)."""
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc", *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    res = run_job(tmp_path_factory.mktemp("tools") / "run", *MLP, "train.steps=30", "fault=kill_worker", "fault.rank=1", "fault.step=10", timeout_s=120)
    assert res.rc == 0, res.out
    return res


def test_status_of_a_finished_run(finished):
    rc, out, err = tool("status", str(finished.run_dir))
    s = finished.summary
    assert rc == 0, err
    assert f"{finished.run_dir}: COMPLETED" in out
    assert f"steps       {s['steps_completed']}/{s['steps_requested']}" in out
    assert f"recoveries  1   downtime {s['recoveries'][0]['downtime_s']:.4f} s" in out


def test_logs_default_is_coordinator_and_rank0(finished):
    rc, out, err = tool("logs", str(finished.run_dir))
    assert rc == 0, err
    sources = {line.split("|")[0].strip() for line in out.splitlines() if "|" in line}
    assert sources == {"coord", "rank0 local0.0"}, sources
    assert "recovered: downtime" in out  # the coordinator's line about the recovery
    stamps = [line.split("| ", 1)[1][:23] for line in out.splitlines() if "| 20" in line]
    assert stamps == sorted(stamps), "lines are merged in time order"


def test_logs_rank_follows_the_replacement(finished):
    rc, out, err = tool("logs", str(finished.run_dir), "--rank", "1")
    assert rc == 0, err
    sources = {line.split("|")[0].strip() for line in out.splitlines() if "|" in line}
    assert sources == {"coord", "rank1 local1.0", "rank1 local2.0"}, sources
    assert "injecting fault: kill_worker of rank 1 at step 10" in out
    assert "checksum ok" in out  # the replacement received the state
    rc, out, _ = tool("logs", str(finished.run_dir), "--rank", "1", "--gen", "1", "--tail", "3")
    assert rc == 0 and len(out.splitlines()) == 3
    assert "local1.0" not in out


@pytest.mark.parametrize(
    "args, needle, value",
    [
        (("logs", "{run}", "--rank", "7"), "--rank 7: no such rank", "ranks 0..1"),
        (("logs", "{run}", "--worker", "nosuch.0"), "worker 'nosuch.0' is not part of run", "{run}"),
        (("logs", "{run}", "--rank", "one"), "'one' is not an integer", "--rank"),
        (("status", "{empty}"), "is not a run directory", "{empty}"),
        (("report", "{missing}"), "does not exist", "{missing}"),
        (("cancel", "{missing}"), "does not exist", "{missing}"),
    ],
)
def test_bad_input_names_the_value_with_a_hint_and_exits_2(finished, tmp_path, args, needle, value):
    paths = {"run": str(finished.run_dir), "empty": str(tmp_path), "missing": str(tmp_path / "nope")}
    rc, out, err = tool(*[a.format(**paths) for a in args])
    assert rc == 2, (out, err)
    assert needle in err and "HINT" in err
    assert value.format(**paths) in err


def test_cancel_of_a_finished_run_does_nothing(finished):
    rc, out, _ = tool("cancel", str(finished.run_dir))
    assert rc == 0 and "nothing to cancel" in out and "completed" in out


def _wait_for(pred, what: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    pause = 0.05
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


def _events(run_dir):
    try:
        text = (run_dir / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines()[:-1]]  # the last line may be half-written


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")


def test_status_logs_and_cancel_of_a_running_job(tmp_path):
    run_dir = tmp_path / "long"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", *MLP, "train.steps=1000000"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        seen = lambda: {e["event"] for e in _events(run_dir)}  # noqa: E731
        _wait_for(lambda: {"step", "spare_ready"} <= seen(), "the first step and the hot spare", 120)
        rc, out, err = tool("status", str(run_dir))
        assert rc == 0, err
        assert f"{run_dir}: RUNNING" in out and f"coordinator pid {proc.pid} is alive" in out
        assert "2 training, 1 hot spare(s) ready" in out
        rc, out, err = tool("logs", str(run_dir), "--tail", "5")
        assert rc == 0 and len(out.splitlines()) == 5, (out, err)
        workers = {e["worker"]: e["pid"] for e in _events(run_dir) if e["event"] == "worker_connected"}
        assert len(workers) == 3

        rc, out, err = tool("cancel", str(run_dir), "--timeout-s", "20")
        assert rc == 0, (out, err)
        # a cancelled local run stops its workers, writes its summary and exits 6 (docs/failure-semantics.md)
        assert f"coordinator pid {proc.pid} stopped (SIGTERM); summary.json: cancelled (exit 6)" in out, out
        assert proc.wait(timeout=20) == 6
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["status"] == "cancelled" and s["exit_code"] == 6 and s["error"] == "cancelled by SIGTERM" and s["steps_completed"] > 0, s
        _wait_for(lambda: not any(_alive(p) for p in workers.values()), "the workers to exit", 30)
        rc, out, _ = tool("status", str(run_dir))
        assert rc == 0 and f"{run_dir}: CANCELLED" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for e in _events(run_dir):  # workers lead their own process groups: end them one by one
            if e["event"] == "worker_connected" and _alive(e["pid"]):
                with open(f"/proc/{e['pid']}/cmdline", "rb") as f:
                    if b"ckptless_hpc.worker" in f.read():
                        os.kill(e["pid"], signal.SIGKILL)
