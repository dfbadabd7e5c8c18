"""End to end on the local backend: real coordinator, real worker processes, real signals.

The oracle: a run with injected faults ends with final_state_sha256 equal to the fault-free
run of the same config and world size.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckpt_testlib import most_spare_nodes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MLP = ("task=mlp", "train.steps=60")
FAST_HB = ("cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped by PID 1 is dead too
        return f.read().split()[2] in ("Z", "X")


def _assert_recovered(res, n_recoveries: int) -> list:
    assert res.rc == 0, res.out
    s = res.summary
    assert s["status"] == "completed" and s["steps_completed"] == s["steps_requested"]
    assert len(s["recoveries"]) == n_recoveries, s["recoveries"]
    for r in s["recoveries"]:
        assert r["survivors_restarted"] == 0
        assert r["bytes_transferred"] > 0
        phases = r["detect_s"] + r["reconfigure_s"] + r["transfer_s"] + r["resume_s"]
        assert abs(phases - r["downtime_s"]) < 0.01, r
    return s["recoveries"]


def _pids_by_worker(res) -> dict:
    return {e["worker"]: e["pid"] for e in res.of("worker_connected")}


def test_kill_worker_default_task(job, baseline):
    """SIGKILL of one worker of the default LM task: a spare takes rank 1, survivors keep their PID."""
    cfg = ("train.steps=40",)
    res = job(*cfg, "fault=kill_worker", "fault.rank=1", "fault.step=20")
    (rec,) = _assert_recovered(res, 1)
    assert res.summary["final_state_sha256"] == baseline(*cfg)
    assert rec["failed_ranks"] == [1] and rec["target_step"] in (20, 21)  # aborted step 20, or completed it: the dead rank's buckets all arrived
    assert rec["replacements"] == {"1": "local2.0"}
    fault = res.of("fault_injected")[0]
    assert _dead(fault["pid"])
    # rank 0 ran in the same process from the first to the last step
    pids = _pids_by_worker(res)
    held = [e for e in res.of("step")]
    assert {e["worker"] for e in held} == {"local0.0"}
    assert pids["local0.0"] != fault["pid"]
    kinds = [e["event"] for e in res.events]
    for k in ("fault_injected", "failure_detected", "generation_bumped", "spare_promoted", "state_transferred", "reformed", "resumed"):
        assert k in kinds, k
    # the console shows the coordinator and rank 0's own log lines (train.console_rank), not rank 1's
    assert "rank=0 node=local0 step=" in res.out and "rank=1 node=local1" not in res.out
    # the coordinator's own lines say which generation and step they are about
    coord_log = (res.run_dir / "coordinator.log").read_text()
    failed = next(line for line in coord_log.splitlines() if "worker local1.0" in line and "failed" in line)
    assert f"job={res.summary['job']} gen=0 step=" in failed, failed
    assert any(" gen=1 step=" in line and "recovered" in line for line in coord_log.splitlines()), coord_log


@pytest.mark.parametrize("control", ["rank", "node"])
def test_kill_node(job, baseline, control):
    """A whole node (2 ranks, one process group; with cluster.control=node its relay too)
    SIGKILLed: one failure. Both ranks move to the spare node in one generation, and one node
    refills the pool (its workers are seen dying one by one: the later ones fold in)."""
    cfg = (*MLP, "cluster.workers_per_node=2")
    res = job(*cfg, f"cluster.control={control}", "fault=kill_node", "fault.node=1", "fault.step=20")
    (rec,) = _assert_recovered(res, 1)
    assert res.summary["final_state_sha256"] == baseline(*cfg)  # a relay changes how frames travel, not what is trained
    assert rec["failed_ranks"] == [2, 3] and rec["failed_nodes"] == ["local1"]
    assert sorted(rec["replacements"].values()) == ["local2.0", "local2.1"]
    assert "local1" in res.summary["excluded_nodes"]
    assert (rec["gen"], rec["attempts"]) == (1, 1) and len(res.of("generation_bumped")) == 1, res.of("generation_bumped")
    assert [e["node"] for e in res.of("spare_launched")] == ["local3"] and most_spare_nodes(res.events) == 1
    assert bool(res.of("relay_connected")) == (control == "node")


def test_hang(job, baseline):
    """SIGSTOP: found by missed heartbeats, survivors released from the allreduce, the hung process killed."""
    res = job(*MLP, *FAST_HB, "fault=hang", "fault.rank=1", "fault.step=25")
    (rec,) = _assert_recovered(res, 1)
    assert res.summary["final_state_sha256"] == baseline(*MLP)
    assert rec["detect_s"] >= 1.5 and "no heartbeat" in rec["reasons"][0]
    assert _dead(res.of("fault_injected")[0]["pid"])


def test_two_faults_in_one_run(job, baseline):
    """A kill, then a hang of another rank after the first recovery (the refilled pool serves the second)."""
    res = job(*MLP, *FAST_HB, "fault=kill_worker", "fault.rank=1", "fault.step=15", "fault.schedule=[{kind:hang,rank:0,step:40}]")
    recs = _assert_recovered(res, 2)
    assert res.summary["final_state_sha256"] == baseline(*MLP)
    assert [r["failed_ranks"] for r in recs] == [[1], [0]]
    assert res.summary["faults_fired"] == [0, 1]
    assert res.of("spare_launched"), "the spare pool was not refilled"
    # the console followed rank 0 from its hung worker to the replacement
    new_rank0 = recs[1]["replacements"]["0"]
    assert f"rank=0 node={new_rank0.split('.')[0]} step=" in res.out, res.out[-3000:]


def test_no_spare_left_stops_cleanly_and_saves_state(job):
    res = job(*MLP, "cluster.spare_nodes=0", "cluster.max_refills=0", "fault=kill_worker", "fault.rank=1", "fault.step=20")
    assert res.rc == 3, res.out
    s = res.summary
    assert s["status"] == "no_spare" and "no spare left" in s["error"] and "HINT" in s["error"]
    saved = s["saved_state"]
    assert saved and os.path.exists(saved["path"]) and saved["step"] in (20, 21)
    state = torch.load(saved["path"], weights_only=True)
    assert state["meta"]["step"] == saved["step"] and any(k.startswith("model.") for k in state["entries"])


def test_worker_startup_error_is_reported_once(job):
    res = job("task=mlp", "+task.no_such_argument=1", timeout_s=120)
    assert res.rc == 4, res.out
    assert "failed at start-up" in res.out and "no_such_argument" in res.out and "Traceback" in res.out
    assert res.summary["status"] == "startup_failed"


def test_task_breaking_the_determinism_contract_is_named(job):
    tasks = str(Path(__file__).parent / "tasks_for_tests")
    res = job("~task", "+task._target_=bad_tasks.GlobalRNGTask", "train.steps=5", env={"PYTHONPATH": tasks}, timeout_s=120)
    assert res.rc == 4, res.out
    assert "bad_tasks.GlobalRNGTask.batch(step, rank, world, generator) breaks the determinism contract" in res.out
    assert "HINT" in res.out


def test_dry_run_prints_the_placement_and_launches_nothing(job):
    res = job("dry_run=true", "cluster.nodes=2", "cluster.workers_per_node=2", "fault=kill_node", timeout_s=120)
    assert res.rc == 0, res.out
    assert "local0     ranks [0, 1]" in res.out and "local2     spare" in res.out and "kill_node of node slot 1" in res.out
    assert not (res.run_dir / "events.jsonl").exists()
    res = job("dry_run=true", "cluster=slurm", "cluster.partition=gpu", timeout_s=120)
    assert res.rc == 0 and "#SBATCH --nodes=3" in res.out and "#SBATCH --no-kill" in res.out and "srun --nodes=1" in res.out


def test_a_workers_own_error_is_the_jobs_error_not_a_lost_worker(job):
    """A survivor's exception (a bug, a model its mode cannot carry) ends the job with that error,
    the rank, the generation and the step; never recovered as a loss, never "no_spare"."""
    tasks = str(Path(__file__).parent / "tasks_for_tests")
    res = job("~task", "+task._target_=bad_tasks.RaisesAtStep", "train.steps=8", env={"PYTHONPATH": tasks}, timeout_s=120)
    assert res.rc == 1, res.out[-3000:]
    s = res.summary
    assert s["status"] == "failed" and not s["recoveries"], s
    assert "the task's own bug at step 3" in s["error"] and "generation 0" in s["error"] and "rank " in s["error"], s["error"]
    assert "spare" not in s["error"]


def test_a_job_that_commits_no_step_is_ended_as_stalled(job):
    """train.stall_timeout_s: rank 1's data hangs at step 3 (its heartbeats go on, so no worker is
    lost, and the collectives' own timeout is far): the job ends, status stalled, naming the step."""
    tasks = str(Path(__file__).parent / "tasks_for_tests")
    res = job("~task", "+task._target_=bad_tasks.StallsAtStep", "train.steps=8", "train.stall_timeout_s=6", "cluster.collective_timeout_s=600", env={"PYTHONPATH": tasks}, timeout_s=180)
    assert res.rc == 1, res.out[-3000:]
    s = res.summary
    assert s["status"] == "stalled" and "after step 3" in s["error"] and "train.stall_timeout_s" in s["error"], s
