"""``cluster.control=node`` end to end: real coordinator, real relay and worker processes, real
signals. The oracle: every run ends bitwise equal to the fault-free run of the same config with
a control connection per rank (the relays change how frames travel, never what is trained)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_testlib import REPO, JobResult, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

MLP2 = ("task=mlp", "train.steps=60", "cluster.workers_per_node=2")
NODE = "cluster.control=node"
FAST_HB = ("cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")


def _relayed(res: JobResult, nodes: int) -> None:
    assert sorted(e["node"] for e in res.of("relay_connected")) == [f"local{i}" for i in range(nodes)]
    connected = res.of("worker_connected")
    assert connected and all(e.get("relayed") for e in connected), connected


def _only_the_failed_replaced(res: JobResult, failed: list) -> None:
    """One recovery, a spare promoted for each failed rank and for nothing else: a survivor that
    missed a message its relay shares among its workers (the abort, the rankless assign) would
    time out, be declared failed and burn a spare while the job still passes."""
    promoted = sorted(e["rank"] for e in res.of("spare_promoted"))
    assert promoted == failed, (f"spares promoted for ranks {promoted}, failed {failed}", res.of("failure_detected"))
    (rec,) = res.summary["recoveries"]
    assert rec["failed_ranks"] == failed and len(rec["replacements"]) == len(failed) and rec["survivors_restarted"] == 0, rec


def test_relayed_workers_train_and_recover_bitwise(job, baseline):
    """A killed worker behind its node's relay costs its rank only; a hung one is found by the
    age its relay reports. Both end equal to the per-rank run."""
    want = baseline(*MLP2)
    res = job(*MLP2, NODE, "fault=kill_worker", "fault.rank=1", "fault.step=20")
    assert res.rc == 0, res.out
    _only_the_failed_replaced(res, [1])  # rank 3 shares its node's relay with rank 2: both get the one shared assign
    _relayed(res, 3)
    assert res.summary["final_state_sha256"] == want
    (rec,) = res.summary["recoveries"]
    assert rec["failed_ranks"] == [1] and rec["replacements"] == {"1": "local2.0"} and rec["survivors_restarted"] == 0
    steps = {e["worker"] for e in res.of("step")}
    assert steps == {"local0.0"}  # rank 0, the killed worker's neighbour behind the same relay, never stopped
    relay_log = (res.run_dir / "logs" / "relay-local0.log").read_text()
    assert "the job is over" in relay_log and "Traceback" not in relay_log and "ERROR" not in relay_log, relay_log  # told the stops, then closed

    hung = job(*MLP2, *FAST_HB, NODE, "fault=hang", "fault.rank=2", "fault.step=20")
    assert hung.rc == 0, hung.out
    _only_the_failed_replaced(hung, [2])  # ranks 0 and 1 share node local0's relay: one abort, one assign for both
    assert hung.summary["final_state_sha256"] == want
    (failed,) = hung.of("failure_detected")
    assert failed["worker"] == "local1.0" and failed["reason"].startswith("no heartbeat for"), failed


def _wait_event(run_dir: Path, pred, proc: subprocess.Popen, timeout_s: float) -> dict:
    def seen():
        assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before the awaited event"
        path = run_dir / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return next((e for e in map(json.loads, lines) if pred(e)), None)

    return wait_for("an event of the relayed job", seen, timeout_s, poll_s=0.05)


def test_a_dead_relay_costs_its_node_and_the_job_goes_on(tmp_path, baseline):
    """SIGKILL of one node's relay alone: both ranks of that node are replaced by the spare
    node's, their worker processes exit (told 'dropped', or losing the relay), bitwise."""
    cfg = ("task=mlp", "train.steps=400", "cluster.workers_per_node=2")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", *cfg, NODE], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        relay = _wait_event(run_dir, lambda e: e["event"] == "relay_connected" and e["node"] == "local1", proc, 120)
        _wait_event(run_dir, lambda e: e["event"] == "step" and e["step"] >= 50, proc, 180)
        os.kill(relay["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    res = JobResult(proc.returncode, out, run_dir)
    assert res.rc == 0, res.out
    assert res.summary["final_state_sha256"] == baseline(*cfg)
    failed = res.of("failure_detected")
    assert sorted(e["worker"] for e in failed) == ["local1.0", "local1.1"], failed
    assert all("relay connection of node local1 closed" in e["reason"] for e in failed), failed
    (rec,) = res.summary["recoveries"]
    assert rec["failed_ranks"] == [2, 3] and sorted(rec["replacements"].values()) == ["local2.0", "local2.1"]
    pids = {e["worker"]: e["pid"] for e in res.of("worker_connected")}
    for w in ("local1.0", "local1.1"):
        try:
            os.kill(pids[w], 0)
            with open(f"/proc/{pids[w]}/stat") as f:
                assert f.read().split()[2] in ("Z", "X"), f"{w} outlived its node's relay"
        except ProcessLookupError:
            pass
