"""resume_from: a new job continues from a saved state and ends bitwise equal to the
uninterrupted run (12 steps, then a new job resumed to 24 with a rank killed on the way, against
24 straight), replicated and sharded; the copies of train.save_every are written while training
goes on, pruned to train.keep_saved, and resumable; a copy of another layout is refused before
anything starts.

The task schedules its own LR (LambdaLR, its state carried in the saved state): the built-in
schedule is a function of train.steps, so a run of 12 steps is not the first half of one of 24.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ENV = {"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")}
TASK = ("~task", "+task._target_=engine_tasks.SGDGroupsMLP", "optim.lr=0.05", "train.grad_accum=2")


@pytest.mark.parametrize("layout", [("parallel=ddp",), ("parallel=zero",)], ids=["ddp", "zero"])
def test_resumed_job_ends_with_the_uninterrupted_runs_hash(layout, job, baseline):
    first = job(*TASK, *layout, "train.steps=12", "cluster.spare_nodes=0", env=ENV)
    assert first.rc == 0, first.out[-3000:]
    assert first.summary["final"]["state"]["files"], first.summary
    second = job(*TASK, *layout, "train.steps=24", f"resume_from={first.run_dir}", "fault=kill_worker", "fault.rank=1", "fault.step=17", env=ENV)
    assert second.rc == 0, second.out[-3000:]
    s = second.summary
    assert s["resumed_from"]["step"] == 12 and len(s["recoveries"]) == 1, s
    assert [e["step"] for e in second.of("step")][0] == 13  # it trained from step 12 on, not from 0
    straight = baseline.result(*TASK, *layout, "train.steps=24", env=ENV)
    assert s["final_state_sha256"] == straight.summary["final_state_sha256"]
    got, want = (torch.load(r.summary["final"]["model"]["path"], weights_only=True) for r in (second, straight))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("layout", [("parallel=ddp",), ("parallel=zero",)], ids=["ddp", "zero"])
def test_periodic_copies_are_written_pruned_and_resumable(layout, job):
    first = job(*TASK, *layout, "train.steps=14", "train.save_every=4", "train.keep_saved=2", "fault=kill_worker", "fault.rank=1", "fault.step=6", env=ENV)
    assert first.rc == 0, first.out[-3000:]
    assert [e["step"] for e in first.of("state_saved") if e.get("periodic")] == [4, 8, 12]  # the kill at 6 lost none
    saved = first.run_dir / "saved"
    assert sorted(p.name for p in saved.iterdir()) == ["step12", "step8"]  # the newest 2 kept
    assert all((saved / k / "index.json").is_file() for k in ("step8", "step12"))
    second = job(*TASK, *layout, "train.steps=14", f"resume_from={saved / 'step8'}", "cluster.spare_nodes=0", env=ENV)
    assert second.rc == 0, second.out[-3000:]
    assert second.summary["resumed_from"]["step"] == 8
    assert second.summary["final_state_sha256"] == first.summary["final_state_sha256"]


def test_a_copy_of_another_layout_is_refused_before_anything_starts(job, tmp_path):
    first = job("task=mlp", "train.steps=3", "cluster.spare_nodes=0")
    assert first.rc == 0, first.out[-3000:]
    res = job("task=mlp", "train.steps=6", "parallel=zero", f"resume_from={first.run_dir}")
    assert res.rc == 2, res.out[-3000:]
    assert "resume_from" in res.out and "holds 1 shard file(s); this job's layout has 2" in res.out and "HINT" in res.out
    res = job("task=mlp", "train.steps=3", f"resume_from={first.run_dir}")
    assert res.rc == 2 and "nothing left to train" in res.out, res.out[-3000:]
    res = job("task=mlp", "train.steps=3", f"resume_from={tmp_path / 'nowhere'}")
    assert res.rc == 2 and "does not exist" in res.out, res.out[-3000:]
