"""How a job ends, in words (coordinator/verdicts.py): pure functions, no job started."""

from __future__ import annotations

import pytest

from ckptless_hpc.coordinator import verdicts
from coordlib import cfg

pytestmark = pytest.mark.timeout(30)


def test_the_newest_step_is_saved_by_the_lowest_rank_holding_it_and_a_fresh_spare_never():
    survivors = {0: "a", 1: "b", 2: "c"}
    assert verdicts.save_holder(survivors, {"a": 5, "b": 7, "c": 7}) == (7, "b")
    assert verdicts.save_holder(survivors, {"a": None, "c": None}) is None  # nothing trained survived


def test_the_final_state_is_written_one_file_per_shard_by_its_lowest_rank():
    rank_of = {"w3": 3, "w0": 0, "w2": 2, "w1": 1}
    assert verdicts.final_writers(rank_of, rank_of, {0: 0, 1: 1, 2: 0, 3: 1}) == {0: "w0", 1: "w1"}
    assert verdicts.final_writers(rank_of, rank_of, {}) == {0: "w0"}  # replicated: one file
    shrunk = {"w0": 0, "w2": 2}  # ZeRO, a job that shrank: w2 steps rank 1's shard (and 3's)
    assert verdicts.final_writers(shrunk, shrunk, {0: 0, 1: 1, 2: 2, 3: 3}, {"w2": [1, 3]}) == {0: "w0", 2: "w2", 1: "w2", 3: "w2"}


def test_what_was_saved_is_said_plainly():
    assert verdicts.where_saved({"step": 4, "path": "/r/e.pt"}, None, None) == "State of step 4 saved to /r/e.pt. "
    assert "already at /r/e.pt and is kept" in verdicts.where_saved({"step": 4, "path": "/r/e.pt", "written": False}, None, None)
    nothing = verdicts.where_saved(None, {"step": 2, "path": "/old"}, "disk full")
    assert nothing == "No state could be saved: disk full. The copy of step 2 this job resumed from stays at /old. "
    assert verdicts.state_lost_where(None) == "No newer state survives: no copy was ever written. "


@pytest.mark.parametrize("lost, status, hint", [(False, "no_spare", "cluster.spare_nodes"), (True, "state_lost", "replication.factor")])
def test_a_job_that_cannot_go_on_says_why_it_was_not_requeued_and_what_to_do(lost, status, hint):
    got, msg = verdicts.not_requeued("no spare left", "Where. ", "not under Slurm", lost)
    assert got == status and msg.startswith("cannot continue: no spare left. Where. Not requeued: not under Slurm. HINT: ") and hint in msg


def test_a_non_finite_step_names_the_step_the_rank_and_the_knob():
    t = cfg("task=mlp").train
    msg = verdicts.nonfinite({"step": 3, "loss": "nan", "rank": 1, "node": "n1"}, {"step": 3, "path": "/s"}, "unused", t)
    assert msg.startswith("step 3 (0-based): loss nan is not finite (rank 1 on node n1, train.on_nonfinite=stop)")
    assert "after 3 committed steps, is saved to /s" in msg and "HINT: lower optim.lr" in msg
    skipped = verdicts.nonfinite({"step": 9, "loss": 1.0, "grad_norm": "inf", "skipped": 4}, None, "No state could be saved: x. ", t)
    assert "gradient norm inf" in skipped and "has dropped 4 of train.steps=" in skipped and "; No state could be saved: x. HINT" in skipped
    assert verdicts.startup_timeout([f"w{i}" for i in range(22)], 5.0).endswith("and 2 more did not start within cluster.startup_timeout_s=5.0s")
