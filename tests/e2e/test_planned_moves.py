"""Planned moves end to end (issue 33): real coordinator, real worker processes, a real
``ckptless-hpc drain`` from another process. The drained node's rank goes to the hot spare at a
step boundary: every rank finishes the steps before it, none is aborted or redone, the drained
node's worker stops (released, not failed), the node is excluded, and the job ends with the
fault-free run's hash."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

from ckpt_testlib import FULL, REPO, JobResult, wait_for
from ckptless_hpc.tools import commands

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

DRAIN_AT = 30  # the step after which the drain is asked
ENV = {"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")}
# steps of ~25 ms (a wait, as on peers, and a little CPU): 240 of them outlast the drain command's start
TASK = ("~task", "+task._target_=waiting_tasks.WaitingMLP", "+task.wait_s=0.02", "+task.burn_s=0.003", "train.steps=240")


def _events(run_dir: Path) -> List[Dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_event(run_dir: Path, pred: Callable[[Dict[str, Any]], bool], proc: subprocess.Popen, timeout_s: float) -> Dict[str, Any]:
    def seen():
        assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before the awaited event"
        return next((e for e in _events(run_dir) if pred(e)), None)

    return wait_for("an event of the job", seen, timeout_s, poll_s=0.05)


def _drain(run_dir: Path, node: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ckptless_hpc", "drain", str(run_dir), node, "--reason", "maintenance (test)", "--wait-s", "120"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)


def drained_run(run_dir: Path, cfg: tuple, node: str = "local1", refused: str = "") -> tuple:
    """Run ``cfg``, drain ``node`` once step DRAIN_AT is committed (``refused``: first a node the
    job does not train on, which must be refused); (the job's result, drain's output)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ENV["PYTHONPATH"], os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", *cfg], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_event(run_dir, lambda e: e["event"] == "spare_ready", proc, 180)  # the spare that takes the rank is built
        _wait_event(run_dir, lambda e: e["event"] == "step" and e["step"] >= DRAIN_AT, proc, 180)
        if refused:
            no = _drain(run_dir, refused)
            assert no.returncode == 2 and f"node {refused!r} never trained in this job" in no.stderr and "HINT" in no.stderr, no.stdout + no.stderr
        drain = _drain(run_dir, node)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return JobResult(proc.returncode, out, run_dir), drain


def _check_moved(res: JobResult, drain: subprocess.CompletedProcess, node: str, ranks: List[int]) -> Dict[str, Any]:
    assert res.rc == 0, res.out[-4000:]
    assert drain.returncode == 0 and f"drain of {node} requested" in drain.stdout and "moved at step" in drain.stdout, drain.stdout + drain.stderr
    s = res.summary
    assert s["status"] == "completed" and s["recoveries"] == [], s["recoveries"]  # a move is no recovery
    (move,) = s["moves"]
    assert move["planned"]["kind"] == "drain" and "maintenance (test)" in move["planned"]["reason"], move
    assert move["failed_ranks"] == ranks and move["failed_nodes"] == [node], move
    assert move["target_step"] == move["planned"]["step"] > DRAIN_AT, move  # the new generation starts at the boundary: nothing rolled back
    assert move["downtime_s"] > 0, move
    # no step redone: rank 0 committed every step once (a redone step would be reported twice)
    steps = [e["step"] for e in res.of("step")]
    assert sorted(steps) == list(range(1, s["steps_completed"] + 1)), "a step was redone or lost"
    assert [e["node"] for e in res.of("node_excluded")] == [node]
    released = res.of("worker_released")
    assert sorted(e["worker"] for e in released) == sorted(f"{node}.{j}" for j in range(len(ranks)))
    assert res.of("failure_detected") == [], res.of("failure_detected")  # the released workers' exits are no failures
    (moved,) = res.of("moved")
    assert moved["planned_step"] == move["planned"]["step"] and moved["nodes"] == [node]
    buf = io.StringIO()
    assert commands.main(["report", str(res.run_dir), "--no-chart"], out=buf) == 0
    assert "planned moves   1" in buf.getvalue() and f"drain of node(s) {node}" in buf.getvalue(), buf.getvalue()
    return move


@pytest.mark.parametrize("mode", ["zero", "fsdp"] + (["ddp"] if FULL else []))  # ddp: tests/slurm's drained node, in CI
def test_a_drained_node_moves_to_the_spare_at_a_boundary_bitwise(tmp_path, baseline, mode):
    cfg = (*TASK, f"parallel={mode}")
    res, drain = drained_run(tmp_path / "run", cfg, refused="local7" if mode == "zero" else "")  # the CLI's refusal: once, in a mode CI runs
    move = _check_moved(res, drain, "local1", [1])
    assert res.summary["final_state_sha256"] == baseline(*cfg, env=ENV)
    assert move["replacements"] == {"1": "local2.0"}
    if mode == "zero":  # the leaving worker served its own shard at the boundary: no copy of an older step was needed
        assert move["bytes_transferred"] > 0


def test_a_straggler_is_replaced_at_a_boundary_and_the_step_time_comes_back(job, baseline):
    """cluster.straggler_action=replace: rank 1's process is made slow (x5 its compute) from step
    10 to past the end; the detector flags it, its node moves to the spare (which is healthy: the
    fault slows the process it fired on), the job's steps are healthy again, bitwise."""
    cfg = ("~task", "+task._target_=waiting_tasks.WaitingMLP", "+task.wait_s=0.005", "+task.burn_s=0.03", "train.steps=300")
    slow = ("fault=slow", "fault.rank=1", "fault.step=10", "fault.duration=1000", "fault.factor=5", "cluster.straggler_action=replace")
    res = job(*cfg, *slow, env=ENV, timeout_s=300)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["final_state_sha256"] == baseline(*cfg, env=ENV) and s["recoveries"] == []
    (move,) = s["moves"]
    assert move["planned"]["kind"] == "straggler" and move["failed_ranks"] == [1] and move["replacements"] == {"1": "local2.0"}, move
    (action,) = res.of("straggler_action")
    assert action["action"] == "replace" and action["rank"] == 1
    steps = {e["step"]: e["step_s"] for e in res.of("step")}
    healthy = sorted(steps[k] for k in range(3, 10))[3]
    slowed = sorted(steps[k] for k in range(15, move["target_step"]))
    after = sorted(steps[k] for k in range(move["target_step"] + 5, s["steps_completed"] + 1))
    # the straggler slowed every step of the job until its rank moved to a healthy process (against
    # the steps after the move: steps 3-9 share the cores with the spare's start-up on a loaded machine)
    assert slowed[len(slowed) // 2] > 2 * after[len(after) // 2], (healthy, slowed, after)
    assert after[len(after) // 2] < 1.5 * healthy, (healthy, after)


# a survivor dies as the move's hold reaches it (fault.at=recovery: on the move's abort, before the
# boundary); the incoming spare dies while it receives the moved rank's state (after the plan took effect)
FAILURE_DURING_MOVE = {
    "survivor": ("fault=kill_worker", "fault.rank=0", "fault.at=recovery", "fault.step=1", "cluster.spare_nodes=2"),
    "incoming_spare": ("fault=kill_worker", "fault.rank=1", "fault.at=receive", "fault.step=1"),
}


@pytest.mark.parametrize("victim,mode", [("survivor", "ddp"), ("incoming_spare", "ddp"), ("incoming_spare", "zero")])
def test_a_failure_during_a_move_falls_back_to_an_ordinary_recovery_bitwise(tmp_path, baseline, victim, mode):
    cfg = (*TASK, f"parallel={mode}")
    res, drain = drained_run(tmp_path / "run", (*cfg, *FAILURE_DURING_MOVE[victim]))
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["final_state_sha256"] == baseline(*cfg, env=ENV)
    (planned,) = res.of("move_planned")[:1]
    (fired,) = res.of("fault_injected")
    rec = s["recoveries"][0]
    assert rec["planned"] is None and rec["failed_ranks"] == [fired["rank"]], rec  # the failure's own record
    if victim == "survivor":  # the spare took rank 0; the drain, asked again, moved rank 1 to the second spare
        (move,) = s["moves"]
        assert move["planned"]["kind"] == "drain" and move["failed_nodes"] == ["local1"] and move["target_step"] > planned["step"], move
        assert drain.returncode == 0 and "moved at step" in drain.stdout, drain.stdout + drain.stderr
        assert [e["worker"] for e in res.of("worker_released")] == ["local1.0"]
    else:  # the rank went back to the leaving worker, at the boundary: nothing rolled back or redone
        assert rec["failed_workers"] == ["local2.0"] and rec["target_step"] == planned["step"], rec
        steps = [e["step"] for e in res.of("step")]
        assert sorted(steps) == list(range(1, s["steps_completed"] + 1)), "a step was redone or lost"
