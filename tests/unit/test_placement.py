"""Placement of shard copies and the planning of a sharded recovery: pure functions."""

from __future__ import annotations

import itertools

import pytest

from ckptless_hpc.coordinator.planner import Spare, plan_sharded_recovery
from ckptless_hpc.coordinator.sharding import Layout
from ckptless_hpc.state.placement import (
    LOST,
    hsdp_tolerance,
    layout_tolerance,
    moved,
    place,
    plan_shards,
    shard_map,
    tolerance,
)

pytestmark = pytest.mark.timeout(30)


def _nodes(n: int, wpn: int) -> dict:
    return {r: f"n{r // wpn}" for r in range(n * wpn)}


@pytest.mark.parametrize("nodes,wpn,factor", [(2, 1, 1), (3, 1, 2), (4, 2, 1), (4, 2, 3), (8, 4, 2), (5, 3, 2)])
def test_every_shard_has_factor_holders_on_distinct_other_nodes(nodes, wpn, factor):
    rn = _nodes(nodes, wpn)
    p = place(rn, factor)
    for owner, holders in p.items():
        assert len(holders) == factor
        used = [rn[owner]] + [rn[h] for h in holders]
        assert len(set(used)) == len(used), (owner, holders)
    assert tolerance(rn, p) == factor
    # load is spread: no rank holds more than ceil(world * factor / world) + 1 copies
    load = [sum(r in hs for hs in p.values()) for r in rn]
    assert max(load) - min(load) <= 1, load


def test_fewer_nodes_than_the_factor_asks_gives_fewer_holders_and_says_so():
    rn = _nodes(2, 2)
    p = place(rn, 3)
    assert all(len(h) == 1 for h in p.values())
    assert tolerance(rn, p) == 1


def test_factor_zero_places_nothing_and_survives_nothing():
    rn = _nodes(3, 1)
    p = place(rn, 0)
    assert p == {0: [], 1: [], 2: []} and tolerance(rn, p) == 0


def test_a_whole_node_replaced_moves_no_copy():
    rn = _nodes(4, 2)
    before = place(rn, 1)
    after_nodes = dict(rn)
    after_nodes[2] = after_nodes[3] = "spare0"  # node n1's two ranks move to a spare node
    after = place(after_nodes, 1, before)
    assert after == before and moved(before, after) == 0


def test_a_rank_moved_onto_its_holders_node_moves_only_that_copy():
    rn = _nodes(3, 2)  # n0: 0,1  n1: 2,3  n2: 4,5
    before = place(rn, 1)
    h0 = before[0][0]
    changed = dict(rn)
    changed[0] = rn[h0]  # rank 0's replacement lands on the node of its own holder
    after = place(changed, 1, before)
    assert changed[after[0][0]] != changed[0]
    # only copies that became invalid moved (rank 0's own, and any copy held on rank 0's new node for a rank there)
    invalid = {o for o, hs in before.items() if any(changed[h] == changed[o] for h in hs)}
    assert {o for o in after if after[o] != before[o]} == invalid
    assert moved(before, after) == len(invalid)


def test_hsdp_tolerance_counts_the_nodes_of_a_shards_replicas():
    assert hsdp_tolerance(4, 1, 2) == 1  # shard 0 on n0, n2
    assert hsdp_tolerance(4, 2, 2) == 1  # shard groups are nodes: replicas on n0 and n1
    assert hsdp_tolerance(4, 2, 1) == 1  # every rank a replica: 4 replicas on 2 nodes
    assert hsdp_tolerance(4, 4, 2) == 0  # everything on one node
    assert hsdp_tolerance(8, 2, 2) == 3
    assert shard_map("hsdp", 4, 2) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert layout_tolerance("zero", 6, 2, 2, None) == 2


def _inv(**workers):
    return {w: {int(k): v for k, v in inv.items()} for w, inv in workers.items()}


def test_target_is_the_newest_step_every_shard_is_held_at():
    shard_of = {0: 0, 1: 1, 2: 2}
    # b died; a is one step ahead (its step committed there only); c holds b's copies at 19, 20
    inv = _inv(a={"0": [19, 20, 21], "2": [20, 21]}, c={"2": [20, 21], "1": [19, 20]})
    ranks_after = {0: "a", 1: "spare", 2: "c"}
    plan, why = plan_shards(ranks_after, shard_of, inv)
    assert plan is not None and plan.target_step == 20, why
    assert plan.sources == {1: ["c"]}  # a and c restore from their own snapshots
    # if c also held b's copy of 21, 21 would be the target (the window closed the other way)
    inv["c"][1] = [20, 21]
    plan, _ = plan_shards(ranks_after, shard_of, inv)
    assert plan.target_step == 21


def test_a_shard_held_by_nobody_is_state_lost_naming_it():
    plan, why = plan_shards({0: "a", 1: "s"}, {0: 0, 1: 1}, _inv(a={"0": [5]}))
    assert plan is None and why.startswith(LOST) and "shard 1 (rank(s) [1])" in why
    plan, why = plan_shards({0: "a", 1: "b"}, {0: 0, 1: 1}, _inv(a={"0": [5]}, b={"1": [6]}))
    assert plan is None and why.startswith(LOST) and "no step" in why


def test_hsdp_replica_serves_a_lost_rank_without_copies():
    shard_of = shard_map("hsdp", 4, 2)
    inv = _inv(a={"0": [30]}, b={"1": [30]}, c={"0": [30]})  # d (rank 3, shard 1) died
    plan, _ = plan_shards({0: "a", 1: "b", 2: "c", 3: "s"}, shard_of, inv)
    assert plan.target_step == 30 and plan.sources == {3: ["b"]}


def test_fetchers_spread_over_holders():
    shard_of = {r: r % 2 for r in range(6)}
    inv = _inv(a={"0": [3]}, b={"1": [3]}, c={"0": [3]}, d={"1": [3]})
    plan, _ = plan_shards({0: "a", 1: "b", 2: "c", 3: "d", 4: "s1", 5: "s2"}, shard_of, inv, max_sources=1)
    assert plan.sources == {4: ["a"], 5: ["d"]}


def test_sharded_recovery_promotes_spares_then_plans_shards():
    ranks = {0: "w0", 1: "w1", 2: "w2"}
    inv = _inv(w0={"0": [9, 10], "2": [9, 10]}, w2={"2": [9, 10], "1": [9, 10]})
    plan, why = plan_sharded_recovery(ranks, {"w1"}, inv, {0: 0, 1: 1, 2: 2}, [Spare("s0", "n9", True)], {"n0", "n1", "n2"}, {"n1"})
    assert plan is not None, why
    assert plan.target_step == 10 and plan.promoted == {1: "s0"} and plan.sources == {"s0": ["w2"]}
    plan, why = plan_sharded_recovery(ranks, {"w1", "w2"}, inv, {0: 0, 1: 1, 2: 2}, [Spare("s0", "n9", True), Spare("s1", "n9", True)], set(), set())
    assert plan is None and why.startswith(LOST)


def test_a_zero_job_that_may_shrink_gives_the_lost_ranks_shards_to_survivors_and_takes_them_back():
    from ckptless_hpc.coordinator.planner import Elastic

    ranks, node = {0: "w0", 1: "w1", 2: "w2"}, {"w0": "n0", "w1": "n1", "w2": "n2"}
    shard_of = {0: 0, 1: 1, 2: 2}
    # w1 lost, no spare: rank 1 goes to w0 (rundir/numbering.py), which holds no copy of shard 1: it fetches it from w2
    inv = _inv(w0={"0": [9, 10], "2": [9, 10]}, w2={"2": [9, 10], "1": [9, 10]})
    plan, why = plan_sharded_recovery(ranks, {"w1"}, inv, shard_of, [], set(), set(), elastic=Elastic(3, 2, node))
    assert plan is not None, why
    assert plan.ranks == {0: "w0", 2: "w2"} and plan.target_step == 10 and plan.sources == {} and plan.adopted == {1: ["w2"]}
    assert "rank(s) [1] trained by the 2 processes on 2 node(s)" in why
    # shard 1's only copy at 10 was lost with its holder: the job goes back to the step every shard is held at
    inv = _inv(w0={"0": [9, 10], "1": [9]}, w2={"2": [9, 10]})
    plan, why = plan_sharded_recovery(ranks, {"w1"}, inv, shard_of, [], set(), set(), elastic=Elastic(3, 2, node))
    assert plan.target_step == 9 and plan.adopted == {}  # w0 holds the copy of shard 1 at 9 itself: nothing to fetch
    # below min_nodes: no plan, the reason says why
    plan, why = plan_sharded_recovery(ranks, {"w1", "w2"}, inv, shard_of, [], set(), set(), elastic=Elastic(3, 2, node))
    assert plan is None and "fewer than cluster.min_nodes=2" in why
    # grown back: a spare takes rank 1, its shard fetched from the survivor that stepped it
    inv = _inv(w0={"0": [12], "1": [12]}, w2={"2": [12], "0": [12]})
    plan, why = plan_sharded_recovery({0: "w0", 2: "w2"}, set(), inv, shard_of, [Spare("s", "n3", True)], set(), set(), elastic=Elastic(3, 2, node))
    assert plan.ranks == {0: "w0", 1: "s", 2: "w2"} and plan.sources == {"s": ["w0"]} and plan.adopted == {}


def test_a_shrunk_zero_layout_copies_the_adopted_shards_to_other_nodes_and_names_their_sources():
    from ckptless_hpc.coordinator.sharding import Layout
    from ckptless_hpc.rundir.numbering import trained_by

    layout = Layout(_cfg("zero", nodes=3))
    trainer = trained_by({0: "w0", 2: "w2"}, 3)
    assert trainer == {0: "w0", 1: "w0", 2: "w2"}
    layout.place({v: {"w0": "n0", "w2": "n2"}[w] for v, w in trainer.items()})
    ends = {"w0": ("h0", 1), "w2": ("h2", 2), "w9": ("h9", 9)}
    f0 = layout.assign_fields(0, trainer, ends, [1], {1: ["w9"]})
    assert f0["shard"] == 0 and [h["worker"] for h in f0["holders"]] == ["w2"]
    assert f0["adopted"] == {"1": {"holders": [{"worker": "w2", "host": "h2", "port": 2}], "sources": [{"worker": "w9", "host": "h9", "port": 9}]}}
    f2 = layout.assign_fields(2, trainer, ends)
    assert f2["holds"] == [0, 1] and [h["worker"] for h in f2["holders"]] == ["w0"] and "adopted" not in f2


class _Cfg(dict):
    __getattr__ = dict.__getitem__


def _cfg(mode, nodes=3, wpn=1, factor=1, shard_size=None):
    return _Cfg(cluster=_Cfg(nodes=nodes, workers_per_node=wpn), parallel=_Cfg(mode=mode, shard_size=shard_size), replication=_Cfg(factor=factor, every=1))


class _Done:
    def __init__(self, sha, shard=None, adopted=None):
        self.sha256, self.shard, self.adopted = sha, shard, adopted


def test_layout_says_what_it_survives_and_fingerprints_the_shards():
    lay = Layout(_cfg("zero", nodes=3, factor=2))
    assert "survives 2 simultaneous node losses" in lay.describe()
    assert "last-resort" in Layout(_cfg("fsdp", factor=0)).describe()
    lay.place({0: "n0", 1: "n1", 2: "n2"})
    f = lay.assign_fields(0, {0: "a", 1: "b", 2: "c"}, {"a": ("h", 1), "b": ("h", 2), "c": ("h", 3)})
    assert f["shard"] == 0 and [h["worker"] for h in f["holders"]] == ["b", "c"] and f["holds"] == [1, 2]
    sha, err = lay.final_sha({"a": _Done("x"), "b": _Done("y"), "c": _Done("z")}, {"a": 0, "b": 1, "c": 2})
    assert err is None and sha
    sha2, _ = lay.final_sha({"a": _Done("x"), "b": _Done("y"), "c": _Done("q")}, {"a": 0, "b": 1, "c": 2})
    assert sha2 != sha  # any shard's bytes change the job's fingerprint
    shrunk, _ = lay.final_sha({"a": _Done("x", shard=0, adopted={"1": "y"}), "c": _Done("z", shard=2)}, {"a": 0, "c": 2})
    assert shrunk == sha  # a job that shrank: the survivor's adopted shard counts as rank 1's
    h = Layout(_cfg("hsdp", nodes=2, wpn=2, shard_size=2))
    sha, err = h.final_sha({"a": _Done("x"), "b": _Done("y"), "c": _Done("x"), "d": _Done("q")}, {"a": 0, "b": 1, "c": 2, "d": 3})
    assert sha is None and "diverged" in err


def test_every_small_layout_places_every_shard_or_reports_less_tolerance():
    for nodes, wpn, factor in itertools.product(range(1, 5), range(1, 4), range(0, 4)):
        rn = _nodes(nodes, wpn)
        p = place(rn, factor)
        assert tolerance(rn, p) == min(factor, nodes - 1)
