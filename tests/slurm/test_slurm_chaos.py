"""CI smoke of ``python -m ckptless_hpc.chaos cluster=slurm``: one drawn schedule on the real
mini-cluster (seed 0 with these kinds draws a cancelled worker step at step 180, then the
preemption signal at step 190: a recovery by the spare, then a save, a requeue that excludes
the lost node, and a resume), every planned fault fired, and the final state equal to the
fault-free run's. The 10+-schedule soak and its table are in docs/failure-semantics.md."""

from __future__ import annotations

import json

import pytest

from ckptless_hpc.chaos import local

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


def test_a_drawn_schedule_fires_every_fault_and_keeps_the_oracle(slurm_env, tmp_path, capsys):
    code = local.main(["cluster=slurm", "runs=1", "seed=0", "steps=300", "kinds=cancel_step,preempt", "redraws=0", f"out={tmp_path}"])
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "chaos.json").read_text())
    (run,) = report["runs"]
    assert [f["kind"] for f in run["faults"]] == ["cancel_step", "preempt"], run["faults"]
    assert run["fired"] == run["planned"] == 2, (run["injections"], printed)
    assert [i["evidence"] for i in run["injections"]] == ["failure_detected", "generation_started"], run["injections"]
    assert run["status"] == "completed" and run["requeues"] == 1 and run["recoveries"] >= 1, run
    assert run["oracle"] and run["final_state_sha256"] == report["baseline_sha256"], run
    assert code == 0, printed
    assert "1/1 Slurm schedules kept the oracle with every planned fault fired (2/2 faults fired" in printed
