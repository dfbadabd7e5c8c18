"""resume_from: a new job continues from a saved state and ends bitwise equal to the
uninterrupted run (12 steps, then a new job resumed to 24 with a rank killed on the way, against
24 straight), replicated and sharded; the copies of train.save_every are written while training
goes on, pruned to train.keep_saved, and resumable, and the copy of step S is the fault-free
run's state at step S although a rank was killed before it was taken; a copy of another layout
is refused before anything starts (no worker, no run file but Hydra's, the copy untouched).

The task schedules its own LR (LambdaLR, its state carried in the saved state): the built-in
schedule is a function of train.steps, so a run of 12 steps is not the first half of one of 24.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Dict

import pytest
import torch

from ckptless_hpc.tools.commands import main as tools_main

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


def _state_hashes(folder: Path) -> Dict[str, str]:
    """Shard -> the sha256 of its training state, from a copy's index.json (final or periodic)."""
    index = json.loads((folder / "index.json").read_text())
    return {k: f["state_sha256"] for k, f in index["files"].items()}


def _exported(path: Path, out: Path) -> Dict[str, torch.Tensor]:
    assert tools_main(["export", str(path), "--out", str(out)], out=io.StringIO()) == 0
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("layout", [("parallel=ddp",), ("parallel=zero",)], ids=["ddp", "zero"])
def test_periodic_copies_are_written_pruned_and_resumable(layout, job, baseline, tmp_path):
    first = job(*TASK, *layout, "train.steps=14", "train.save_every=4", "train.keep_saved=2", "fault=kill_worker", "fault.rank=1", "fault.step=6", env=ENV)
    assert first.rc == 0, first.out[-3000:]
    # the kill fired (and was recovered from) before the copies of steps 8 and 12 were taken
    assert len(first.summary["faults_fired"]) == 1 and len(first.summary["recoveries"]) == 1, first.summary
    assert [e["step"] for e in first.of("state_saved") if e.get("periodic")] == [4, 8, 12]  # the kill at 6 lost none
    saved = first.run_dir / "saved"
    assert sorted(p.name for p in saved.iterdir()) == ["step12", "step8"]  # the newest 2 kept
    assert all((saved / k / "index.json").is_file() for k in ("step8", "step12"))
    second = job(*TASK, *layout, "train.steps=14", f"resume_from={saved / 'step8'}", "cluster.spare_nodes=0", env=ENV)
    assert second.rc == 0, second.out[-3000:]
    assert second.summary["resumed_from"]["step"] == 8
    assert second.summary["final_state_sha256"] == first.summary["final_state_sha256"]
    # the copy of step 12, taken while step 13 trained, is the state of step 12: that of the
    # fault-free run of 12 steps (the task's own LR schedule: 12 steps are the first 12 of 14),
    # every shard's whole training state by its hash, and the model it exports
    at_12 = baseline.result(*TASK, *layout, "train.steps=12", env=ENV)
    assert _state_hashes(saved / "step12") == _state_hashes(at_12.run_dir / "final" / "state")
    got, want = _exported(saved / "step12", tmp_path / "step12.pt"), torch.load(at_12.summary["final"]["model"]["path"], weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _files(run_dir: Path) -> Dict[str, int]:
    """Every file under ``run_dir`` (relative path -> mtime in ns)."""
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}


def _processes_naming(path: Path) -> list:
    """Live processes whose command line names ``path`` (a job's coordinator and workers do)."""
    hits = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmd:
            hits.append((int(pid), cmd[:200]))
    return hits


def test_a_copy_of_another_layout_is_refused_before_anything_starts(job, tmp_path):
    first = job("task=mlp", "train.steps=3", "cluster.spare_nodes=0")
    assert first.rc == 0, first.out[-3000:]
    copy_before = _files(first.run_dir)
    res = job("task=mlp", "train.steps=6", "parallel=zero", f"resume_from={first.run_dir}")
    assert res.rc == 2, res.out[-3000:]
    assert "resume_from" in res.out and "holds 1 shard file(s); this job's layout has 2" in res.out and "HINT" in res.out
    # nothing started: no worker (no log of one, no process left), no event, no summary, no
    # address: the run directory holds Hydra's record of the command and the CLI's log only
    left = _files(res.run_dir)
    assert all(f.startswith(".hydra/") or f == "cli.log" for f in left), f"the refused job left {sorted(left)}"
    assert not (res.run_dir / "logs").exists() and not (res.run_dir / "events.jsonl").exists()
    assert _processes_naming(res.run_dir) == []
    assert _files(first.run_dir) == copy_before  # the copy it refused is untouched
    res = job("task=mlp", "train.steps=3", f"resume_from={first.run_dir}")
    assert res.rc == 2 and "nothing left to train" in res.out, res.out[-3000:]
    res = job("task=mlp", "train.steps=3", f"resume_from={tmp_path / 'nowhere'}")
    assert res.rc == 2 and "does not exist" in res.out, res.out[-3000:]
