"""Parameters first and several sources at once, end to end (real coordinator, workers, signals).

A replacement fetches the parameters (and buffers, the task's tensors, the scalars), starts the
redone step, and receives the optimizer state behind its forward and backward; the step's last
collective waits for it. The oracle: the final state is bitwise the fault-free run's. What
happened when is read from the workers' own logs, not assumed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

TASKS = {"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")}
# BatchNorm (buffers), dropout, OneCycleLR, AdamW, several layers, accumulation, clipping
RICH = ("~task", "+task._target_=engine_tasks.ShardedRichMLP", "train.steps=40", "train.grad_accum=2", "train.clip_grad_norm=0.5")
FAST_HB = ("cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")
KILL = ("fault=kill_worker", "fault.rank=1", "fault.step=12")
HANG = (*FAST_HB, "fault=hang", "fault.rank=1", "fault.step=20")


def _oracle(res, sha: str, recoveries: int = 1) -> list:
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["status"] == "completed" and s["final_state_sha256"] == sha
    assert len(s["recoveries"]) == recoveries, s["recoveries"]
    assert all(r["survivors_restarted"] == 0 for r in s["recoveries"])
    return s["recoveries"]


def _log(res, worker: str) -> list:
    return (res.run_dir / "logs" / f"{worker}.log").read_text().splitlines()


def _line(lines: list, pattern: str, after: int = -1) -> int:
    """Index of the first line after ``after`` matching ``pattern``."""
    for i, line in enumerate(lines):
        if i > after and re.search(pattern, line):
            return i
    raise AssertionError(f"no line matching {pattern!r} after line {after}:\n" + "\n".join(lines[-40:]))


def _model_bytes(res) -> int:
    """Parameters + buffers: what a built worker holds at step 0, before AdamW has any state."""
    return res.of("worker_ready")[0]["state_bytes"]


def _params(res) -> int:
    return res.of("worker_ready")[0]["params"]


def _behind_in_order(lines: list, step: int) -> int:
    """The parameters received, then the step started on them, then the optimizer state received
    behind it: the line numbers prove the order."""
    got = _line(lines, rf"received parameters: .* at step {step} ")
    started = _line(lines, rf"step {step} started on the parameters; the optimizer state follows behind", got)
    _line(lines, rf"received optimizer state: .* at step {step} .* behind the step \(arrived [0-9.]+s after the step started", started)
    return started


@pytest.mark.parametrize("fault", [KILL, HANG], ids=["kill", "hang"])
def test_parameters_first_keeps_the_oracle(fault, job, baseline):
    res = job(*RICH, *fault, env=TASKS)
    (rec,) = _oracle(res, baseline(*RICH, env=TASKS))
    lines = _log(res, rec["replacements"]["1"])
    _behind_in_order(lines, rec["target_step"])
    # only the parameters and buffers were on the critical path (AdamW's two moments, 2/3 of the state, came behind)
    assert rec["bytes_transferred"] == _model_bytes(res), (rec["bytes_transferred"], _model_bytes(res))
    if "hang" in fault:
        assert rec["reasons"][0].startswith("no heartbeat")


@pytest.mark.parametrize("damage, words", [("corrupt_transfer", "checksum mismatch"), ("truncate_transfer", "truncated")])
def test_damaged_optimizer_state_arriving_behind_the_step_is_fetched_again(damage, words, job, baseline):
    res = job(*RICH, *KILL, f"fault.schedule=[{{kind:{damage},rank:0,step:0,at:optimizer}}]", env=TASKS)
    (rec,) = _oracle(res, baseline(*RICH, env=TASKS))
    step = rec["target_step"]
    (err,) = res.of("transfer_error")
    assert err["source"] == "local0.0" and words in err["error"], err
    assert f"optimizer state, received behind step {step} (started" in err["error"], err
    # the replacement: parameters in, step started, then the damaged optimizer state, then a good one
    lines = _log(res, rec["replacements"]["1"])
    started = _behind_in_order(lines, step)
    failed = _line(lines, r"state fetch from local0.0 failed: optimizer state, received behind step", started)
    _line(lines, r"received optimizer state: .* behind the step", failed)
    # the source damaged the optimizer's part, not the parameters (which arrived intact first)
    source = _log(res, "local0.0")
    _line(source, rf"injecting fault: {damage} of rank 0 during optimizer .* in the optimizer state served")
    assert len(res.of("state_transferred")) == 1  # the parameters, once: nothing was fetched twice but the damaged part


def test_parameters_first_off_fetches_the_whole_state_first(job, baseline):
    cfg = (*RICH, "cluster.params_first=false")
    res = job(*cfg, *KILL, env=TASKS)
    (rec,) = _oracle(res, baseline(*RICH, env=TASKS))  # the switch changes when bytes move, never the result
    lines = _log(res, rec["replacements"]["1"])
    _line(lines, rf"received state: .* at step {rec['target_step']} ")
    assert not any("behind" in line for line in lines)
    assert rec["bytes_transferred"] >= _model_bytes(res) + 2 * 4 * _params(res)  # with AdamW's two fp32 moments


def test_several_sources_at_once_and_a_source_dying_mid_way(job, baseline):
    """Three nodes: the replacement takes disjoint groups from both survivors at once; then, in a
    second run, one of them dies as it serves: its group comes from the other."""
    cfg = (*RICH, "cluster.nodes=3", "cluster.spare_nodes=2")
    sha = baseline(*cfg, env=TASKS)
    res = job(*cfg, *KILL, env=TASKS)
    (rec,) = _oracle(res, sha)
    lines = _log(res, rec["replacements"]["1"])
    both = lines[_line(lines, r"received parameters: ")]
    assert "local0.0 (" in both and "local2.0 (" in both, both
    both = lines[_line(lines, r"received optimizer state: ")]
    assert "local0.0 (" in both and "local2.0 (" in both, both

    res = job(*cfg, *KILL, "fault.schedule=[{kind:kill_worker,rank:0,at:send,step:0}]", env=TASKS)
    (rec,) = _oracle(res, sha)
    assert rec["attempts"] >= 2 and len(rec["failed_workers"]) == 2
    first = rec["replacements"]["1"]
    lines = _log(res, first)
    failed = _line(lines, r"state fetch from local0.0 failed: parameters \(group 1 of 2\)")
    got = lines[_line(lines, r"received parameters: ", failed)]
    assert "local2.0 (" in got and "local0.0 (" not in got, got  # both groups from the source left
