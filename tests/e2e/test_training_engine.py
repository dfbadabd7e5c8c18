"""The training engine end to end: each feature alone and all of them together, under the
oracle (a run with injected faults ends bitwise equal to the fault-free run of its config),
with killed workers (rank 0 and others), a hang and a killed node of 2 ranks.

Each feature's run is also checked for having had an effect (its fault-free hash differs from
the plain config's, or it equals another path's that must give the same bytes), so that an
option silently ignored cannot pass.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch

from ckpt_testlib import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TASKS = {"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")}
MLP = ("task=mlp", "train.steps=60")
FAST_HB = ("cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")
EXAMPLES = f"hydra.searchpath=[file://{REPO}/examples/conf]"


def _task(name: str) -> tuple:
    return ("~task", f"+task._target_=engine_tasks.{name}", "train.steps=60")


KILL0 = ("fault=kill_worker", "fault.rank=0", "fault.step=20")
KILL1 = ("fault=kill_worker", "fault.rank=1", "fault.step=25")
HANG1 = (*FAST_HB, "fault=hang", "fault.rank=1", "fault.step=30")
NODE1 = ("cluster.workers_per_node=2", "fault=kill_node", "fault.node=1", "fault.step=15")

# feature -> (config, fault); the faults rotate over the kinds
FEATURES = {
    "buffers": (_task("BatchNormMLP"), KILL0),
    "grad_accum": ((*MLP, "train.grad_accum=4"), HANG1),
    "clip": ((*MLP, "train.clip_grad_norm=0.05"), KILL1),
    "scheduler": (_task("OneCycleMLP"), NODE1),
    "bf16": ((*MLP, "train.precision=bf16"), KILL0),
    "fp16": ((*MLP, "train.precision=fp16"), KILL1),
    "micro_signature": ((*_task("MicroMLP"), "train.grad_accum=2"), KILL0),
    "dtypes": (_task("MixedDtypeMLP"), KILL1),
    "buckets": (("train.steps=20", "task.d_model=64", "train.bucket_mb=0.05"), ("fault=kill_worker", "fault.rank=1", "fault.step=10")),
}


def _oracle(res, sha: str, recoveries: int = 1) -> dict:
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["status"] == "completed" and s["steps_completed"] == s["steps_requested"], s
    assert len(s["recoveries"]) == recoveries, s["recoveries"]
    assert len(s["faults_fired"]) == len(s["faults"]), (s["faults_fired"], s["faults"])
    assert s["final_state_sha256"] == sha
    return s


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_alone_keeps_the_oracle(feature, job, baseline):
    cfg, fault = FEATURES[feature]
    cfg = (*cfg, *(o for o in fault if o.startswith("cluster.workers_per_node")))
    res = job(*cfg, *(o for o in fault if o not in cfg), env=TASKS)
    sha = baseline(*cfg, env=TASKS)
    _oracle(res, sha)
    # the trained model the faulted job leaves is the fault-free job's, bitwise, and loads into a fresh model
    got, want = (torch.load(r.summary["final"]["model"]["path"], weights_only=True) for r in (res, baseline.result(*cfg, env=TASKS)))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), feature
    assert res.summary["final"]["model"]["sha256"] == baseline.result(*cfg, env=TASKS).summary["final"]["model"]["sha256"]
    ready = res.of("worker_ready")
    if feature in ("grad_accum", "clip", "bf16", "fp16"):  # the option changed the numbers
        assert sha != baseline(*MLP), f"{feature} had no effect on the final state"
    if feature == "buffers":
        assert all(e["buffers"] == 3 for e in ready)  # running mean, var, count
    if feature == "buckets":
        assert all(e["buckets"] >= 4 for e in ready), ready
    if feature == "clip":
        norms = [e["grad_norm"] for e in res.of("step")]
        assert max(norms) > 0.05, "the gradient never needed clipping: the test proves nothing"


ALL = (
    EXAMPLES, "task=vision_cnn", "train.steps=40", "train.grad_accum=4", "train.clip_grad_norm=0.5", "train.precision=bf16",
    "train.data_workers=2", "optim.lr=0.01", "cluster.workers_per_node=2", "cluster.heartbeat_interval_s=0.25",
    "cluster.heartbeat_timeout_s=2",
)


def test_all_features_together_survive_every_kind_of_fault(job, baseline):
    """BatchNorm + dropout, grad_accum=4, clipping, the task's SequentialLR, bf16 autocast and a
    DataLoader with 2 worker processes, on 2 nodes x 2 ranks: a killed node (2 ranks), a killed
    rank 0, a killed non-zero rank and a hang in one run."""
    res = job(
        *ALL, "fault=kill_node", "fault.node=1", "fault.step=6",
        "fault.schedule=[{kind:kill_worker,rank:0,step:14},{kind:kill_worker,rank:3,step:22},{kind:hang,rank:1,step:30}]",
    )
    s = _oracle(res, baseline(*ALL), recoveries=4)
    failed = [r["failed_ranks"] for r in s["recoveries"]]
    assert failed == [[2, 3], [0], [3], [1]], failed
    assert s["recoveries"][3]["reasons"][0].startswith("no heartbeat")
    # the survivors' prefetching loaders were re-seeked; the same bytes as batches made in-process
    assert baseline(*ALL) == baseline(*(o for o in ALL if o != "train.data_workers=2"))


def test_nonfinite_loss_stops_at_the_last_finite_state(job):
    res = job("train.steps=40", "optim.lr=1e9")
    assert res.rc == 7, res.out[-3000:]
    s = res.summary
    assert s["status"] == "nonfinite"
    nf = res.of("nonfinite")[0]
    assert f"step {nf['step']} (0-based): loss nan is not finite (rank {nf['rank']} on node" in s["error"] and "HINT" in s["error"]
    saved = s["saved_state"]
    assert saved["step"] == nf["step"] == s["steps_completed"]
    state = torch.load(saved["path"], weights_only=True)
    assert state["meta"]["step"] == saved["step"]
    assert all(torch.isfinite(t).all() for k, t in state["entries"].items() if t.is_floating_point()), "a non-finite value was committed"


def test_skipping_past_max_skipped_fraction_stops_with_exit_7_and_strict_json(job):
    """on_nonfinite=skip with steps 3-12 of 60 non-finite: the 7th of them (step 9; the default
    max_skipped_fraction=0.1 allows 6) stops the job as on_nonfinite=stop does, the state saved
    the user's only; every file of the record is strict JSON (no bare NaN)."""
    res = job(*_task("NanAtStepMLP"), f"+task.nan_steps={list(range(3, 13))}", "train.on_nonfinite=skip", env=TASKS)
    assert res.rc == 7, res.out[-3000:]
    s = json.loads((res.run_dir / "summary.json").read_text(), parse_constant=_refuse)
    assert s["status"] == "nonfinite" and s["skipped_steps"]["nonfinite"] == 6, s
    assert "train.on_nonfinite=skip has dropped 6 of train.steps=60 steps already, the most train.max_skipped_fraction=0.1 allows" in s["error"], s["error"]
    assert "HINT" in s["error"] and s["saved_state"]["step"] == s["steps_completed"] == 9 and "step 9 (0-based)" in s["error"]
    for line in (res.run_dir / "events.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=_refuse)
    assert [e["loss"] for e in res.of("step") if e.get("skipped")] == ["nan"] * 6, "a non-finite loss is named, as a string"
    assert stat.S_IMODE(os.stat(s["saved_state"]["path"]).st_mode) == 0o600  # the user's model: the user's only
    assert stat.S_IMODE(os.stat(res.run_dir).st_mode) == 0o700


def _refuse(token):
    raise AssertionError(f"not JSON: a bare {token}")


def test_nonfinite_steps_skipped_identically_and_counted_across_a_recovery(job):
    cfg = (*_task("NanAtStepMLP"), "+task.nan_steps=[7,30]", "train.on_nonfinite=skip")
    ref = job(*cfg, env=TASKS)
    assert ref.rc == 0, ref.out[-3000:]
    assert ref.summary["skipped_steps"] == {"nonfinite": 2, "overflow": 0}
    assert [e["step"] for e in ref.of("step") if e.get("skipped")] == [8, 31]
    res = job(*cfg, *KILL0, env=TASKS)  # rank 0's replacement learns the count (1) with the state
    s = _oracle(res, ref.summary["final_state_sha256"])
    assert s["skipped_steps"] == {"nonfinite": 2, "overflow": 0}


def test_tensorboard_gets_the_curves_and_the_recovery(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    res = job(*MLP, "train.tensorboard=true", "train.clip_grad_norm=1.0", *KILL1)
    assert res.rc == 0, res.out[-3000:]
    acc = EventAccumulator(str(res.run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/samples_per_s", "recovery/downtime_s"} <= tags, tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 61))
    (rec,) = acc.Scalars("recovery/downtime_s")
    assert math.isclose(rec.value, res.summary["recoveries"][0]["downtime_s"], rel_tol=1e-6)


@pytest.mark.parametrize(
    "task, words",
    [("StreamTask", "a source without random access"), ("SyncBNTask", "SyncBatchNorm")],
)
def test_unsupported_task_is_refused_at_start(task, words, job):
    res = job(*_task(task), env=TASKS, timeout_s=120)
    assert res.rc == 4, res.out[-3000:]
    assert words in res.out and "HINT" in res.out
