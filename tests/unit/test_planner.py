"""The recovery planner and the heartbeat detector are pure: no processes, no clocks."""

from __future__ import annotations

import pytest

from ckptless_hpc.coordinator.detector import silent_workers
from ckptless_hpc.coordinator.planner import Elastic, Spare, initial_ranks, plan_recovery

pytestmark = pytest.mark.timeout(10)

RANKS = {0: "a.0", 1: "a.1", 2: "b.0", 3: "b.1"}


def test_initial_ranks_node_by_node():
    assert initial_ranks([("a", ["a.0", "a.1"]), ("b", ["b.0", "b.1"])]) == RANKS


def test_node_failure_moves_both_ranks_to_one_spare_node():
    spares = [Spare("s.0", "s", True), Spare("s.1", "s", True), Spare("t.0", "t", True)]
    held = {"a.0": 7, "a.1": 7}
    plan, reason = plan_recovery(RANKS, {"b.0", "b.1"}, held, spares, {"a", "b"}, {"b"})
    assert plan.target_step == 7 and plan.promoted == {2: "s.0", 3: "s.1"}
    assert plan.ranks == {0: "a.0", 1: "a.1", 2: "s.0", 3: "s.1"}
    assert plan.sources == {"s.0": ["a.0", "a.1"], "s.1": ["a.1", "a.0"]}  # spread over holders
    assert "target step 7" in reason


def test_survivor_ahead_by_one_step_sets_the_target():
    held = {"a.0": 8, "a.1": 7, "b.0": 7}
    plan, _ = plan_recovery(RANKS, {"b.1"}, held, [Spare("s.0", "s", True)], {"a", "b"}, {"b"})
    assert plan.target_step == 8
    assert set(plan.sources) == {"a.1", "b.0", "s.0"} and all(v == ["a.0"] for v in plan.sources.values())


def test_spares_on_bad_nodes_and_unbuilt_spares():
    spares = [Spare("x.0", "x", True), Spare("y.0", "y", False), Spare("z.0", "z", True)]
    plan, _ = plan_recovery(RANKS, {"a.1"}, {"a.0": 3, "b.0": 3, "b.1": 3}, spares, {"a", "b"}, {"a", "x"})
    assert plan.promoted == {1: "z.0"}  # x is bad, y not built yet


def test_no_spare_left():
    plan, reason = plan_recovery(RANKS, {"a.1", "b.1"}, {"a.0": 3, "b.0": 3}, [Spare("s.0", "s", True)], set(), set())
    assert plan is None and "no spare left" in reason and "[1, 3]" in reason


def test_no_state_left():
    plan, reason = plan_recovery({0: "a.0"}, {"a.0"}, {}, [Spare("s.0", "s", True)], set(), set())
    assert plan is None and "no surviving rank" in reason


def test_reform_without_failures_keeps_everyone():
    plan, _ = plan_recovery(RANKS, set(), {w: 5 for w in RANKS.values()}, [], set(), set())
    assert plan.ranks == RANKS and plan.promoted == {} and plan.sources == {}


def test_silent_workers():
    seen = {"a": 10.0, "b": 12.5, "c": 9.0}
    out = silent_workers(13.0, seen, ["a", "b"], timeout_s=2.0)
    assert [w for w, _ in out] == ["a"] and "no heartbeat for 3.0s" in out[0][1]


# ---------------------------------------------------------------- elastic (cluster.min_nodes)
NODE = {"a.0": "a", "a.1": "a", "b.0": "b", "b.1": "b", "c.0": "c", "c.1": "c"}
SIX = {0: "a.0", 1: "a.1", 2: "b.0", 3: "b.1", 4: "c.0", 5: "c.1"}


def test_with_no_spare_a_job_that_may_shrink_goes_on_with_its_survivors():
    held = {w: 9 for w in SIX.values()}
    plan, reason = plan_recovery(SIX, {"c.0", "c.1"}, held, [], {"a", "b", "c"}, {"c"}, elastic=Elastic(6, 2, NODE))
    assert plan.ranks == {r: w for r, w in SIX.items() if r < 4} and plan.promoted == {} and plan.sources == {}
    assert "rank(s) [4, 5] trained by the 4 processes on 2 node(s)" in reason and plan.target_step == 9
    # below cluster.min_nodes: no plan, and why
    plan, reason = plan_recovery(SIX, {"b.0", "b.1", "c.0", "c.1"}, held, [], {"a", "b", "c"}, set(), elastic=Elastic(6, 2, NODE))
    assert plan is None and "on 1 node(s), fewer than cluster.min_nodes=2" in reason and "[2, 3, 4, 5]" in reason
    # not elastic: the old verdict
    assert plan_recovery(SIX, {"c.0", "c.1"}, held, [], set(), set())[0] is None


def test_spares_fill_the_lowest_ranks_without_a_process_and_a_shrunk_job_grows_back():
    shrunk = {r: w for r, w in SIX.items() if r < 4}
    held = {w: 12 for w in shrunk.values()}
    one = [Spare("d.0", "d", True)]
    plan, reason = plan_recovery(shrunk, set(), held, one, {"a", "b"}, {"c"}, elastic=Elastic(6, 2, {**NODE, "d.0": "d"}))
    assert plan.promoted == {4: "d.0"} and sorted(plan.ranks) == [0, 1, 2, 3, 4] and plan.sources == {"d.0": ["a.0", "a.1", "b.0", "b.1"]}
    assert "rank 4 -> d.0" in reason and "rank(s) [5] trained by" in reason
    two = one + [Spare("d.1", "d", True)]
    plan, reason = plan_recovery(shrunk, set(), held, two, {"a", "b"}, {"c"}, elastic=Elastic(6, 2, NODE))
    assert plan.ranks == {**shrunk, 4: "d.0", 5: "d.1"} and "trained by" not in reason  # whole again
    # a failure in a shrunk job with one spare: the failed rank first (the lowest), the rest stay with the survivors
    plan, _ = plan_recovery(shrunk, {"a.1"}, {"a.0": 12, "b.0": 12, "b.1": 12}, one, {"a", "b"}, {"c"}, elastic=Elastic(6, 2, NODE))
    assert plan.promoted == {1: "d.0"} and sorted(plan.ranks) == [0, 1, 2, 3]
