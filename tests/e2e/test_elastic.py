"""Elastic and still bitwise (cluster.min_nodes): with no spare left a node loss shrinks the job,
the survivors train the lost ranks' micro-batches too, and the job ends with exactly the bits of
the fault-free run of the same config (the fixed-order reduction in both). Real coordinator,
real worker processes, real signals. A loss below cluster.min_nodes stops the job as before."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ENV = {"PYTHONPATH": str(Path(__file__).parent / "tasks_for_tests")}
# BatchNorm (rank 0's statistics), dropout, two micro-batches, a clip that bites; three nodes, no spare
ELASTIC = (
    "~task",
    "+task._target_=engine_tasks.BatchNormSGD",
    "optim.lr=0.05",
    "train.steps=150",
    "train.grad_accum=2",
    "train.clip_grad_norm=0.05",
    "cluster.nodes=3",
    "cluster.spare_nodes=0",
    "cluster.min_nodes=2",
    "cluster.max_refills=0",  # no node to grow back with (the grow-back test gives one: the bits do not depend on it)
)


def _shrunk(res, lost_node: str) -> dict:
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["status"] == "completed" and s["steps_completed"] == s["steps_requested"], s
    assert len(s["faults_fired"]) == len(s["faults"]) == 1, s
    (shrunk,) = res.of("shrunk")
    assert shrunk["processes"] == 2 and shrunk["nodes"] == 2, shrunk
    (excluded,) = res.of("node_excluded")
    assert excluded["node"] == lost_node
    return shrunk


@pytest.mark.parametrize("node", [2, 0])
def test_a_node_lost_with_no_spare_shrinks_and_ends_with_the_fault_free_bits(node, job, baseline):
    """Node 2 (a rank the survivors take on), node 0 (rank 0: its buffers, metrics and the final
    export move to another process)."""
    res = job(*ELASTIC, "fault=kill_node", f"fault.node={node}", "fault.step=15", env=ENV)
    shrunk = _shrunk(res, f"local{node}")
    assert shrunk["ranks"] == sorted({0, 1, 2} - {node})
    fault_free = baseline.result(*ELASTIC, env=ENV).summary
    assert res.summary["final_state_sha256"] == fault_free["final_state_sha256"]
    assert res.summary["final"]["model"]["sha256"] == fault_free["final"]["model"]["sha256"]
    assert not fault_free["recoveries"] and not baseline.result(*ELASTIC, env=ENV).of("shrunk")
    assert res.summary["workers"] == "2/3 (degraded)" and res.summary["degraded"]["spans"][0]["to_step"] == 150


def test_shrunk_then_grown_back_from_a_refill_ends_with_the_fault_free_bits(job, baseline):
    """The coordinator starts a node for the lost ranks; once built, a re-forming with nothing
    failed hands it rank 2 back, its state fetched from a peer. Rank 0 runs 5x slower for a while
    after the loss (a straggler fault: timing only) so that the refill is there well before the end."""
    slow = "fault.schedule=[{kind:slow,rank:0,step:16,duration:100}]"
    res = job(*ELASTIC, "cluster.max_refills=1", "fault=kill_node", "fault.node=2", "fault.step=15", slow, env=ENV)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["status"] == "completed" and len(s["faults_fired"]) == 2, s
    (shrunk,), (grown,) = res.of("shrunk"), res.of("grown")
    assert shrunk["processes"] == 2 and grown["processes"] == 3 and grown["step"] > shrunk["step"]
    assert s["final_state_sha256"] == baseline(*ELASTIC, env=ENV)
    (grow,) = s["moves"]  # the grow-back is a planned move at a step boundary (issue 33): the degraded step in flight finished
    assert [r["replacements"] for r in s["recoveries"]] == [{}] and grow["replacements"] == {"2": res.of("spare_launched")[0]["node"] + ".0"}
    assert grow["bytes_transferred"] > 0 and grow["failed_ranks"] == [] and grow["t_fail"] == grow["t_detect"]  # caused by no fault: timed from the boundary
    assert grow["planned"]["kind"] == "grow" and grow["target_step"] == grow["planned"]["step"] == grown["step"]
    (span,) = s["degraded"]["spans"]
    assert (span["from_step"], span["to_step"], span["processes"]) == (shrunk["step"], grown["step"], 2) and span["seconds"] > 0
    assert s["workers"] == "3/3"


def test_a_loss_below_min_nodes_stops_the_job_as_before(job):
    res = job(*ELASTIC, "fault=kill_node", "fault.node=1", "fault.step=10", "fault.schedule=[{kind:kill_node,node:2,step:20}]", env=ENV)
    assert res.rc == 3, res.out[-4000:]
    s = res.summary
    assert s["status"] == "no_spare" and "fewer than cluster.min_nodes=2" in s["error"], s["error"]
    assert len(res.of("shrunk")) == 1 and s["saved_state"]["step"] in (20, 21)


ZERO = (*ELASTIC, "parallel=zero", "replication.factor=1")


@pytest.mark.timeout(480)
def test_zero_shrinks_its_shards_onto_the_survivors_and_grows_back_with_the_fault_free_bits(job, baseline):
    """parallel=zero: the survivor that trains the lost rank steps its part of the optimizer too,
    from the copy a peer held (one loss right after its optimizer update: the consistency window);
    a refill grows the job back, its shard fetched from that survivor; every shard ends with the
    fault-free bits. (A zero job that stays shrunk to its end: the next test, and
    tests/e2e/test_plain_pytorch.py ``shrunk_zero``.)"""
    slow = "fault.schedule=[{kind:slow,rank:0,step:16,duration:100}]"
    res = job(*ZERO, "cluster.max_refills=1", "fault=kill_node", "fault.node=1", "fault.step=15", "fault.at=update", slow, env=ENV)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    fault_free = baseline(*ZERO, env=ENV)
    assert s["status"] == "completed" and len(s["faults_fired"]) == 2, s
    (shrunk,), (grown,) = res.of("shrunk"), res.of("grown")
    assert shrunk["processes"] == 2 and shrunk["ranks"] == [0, 2] and grown["processes"] == 3
    assert s["final_state_sha256"] == fault_free
    assert s["recoveries"][0]["bytes_transferred"] > 0, "the adopted shard came from nowhere"  # node 1's copy lives on another node
    assert s["moves"][0]["bytes_transferred"] > 0 and s["workers"] == "3/3"  # the grow-back: a planned move
    assert s["final"]["model"]["sha256"] == baseline.result(*ZERO, env=ENV).summary["final"]["model"]["sha256"]


def test_zero_survives_a_second_loss_while_shrunk_from_the_copies_of_the_adopted_shards(job, baseline):
    """min_nodes=1: node 1 is lost (rank 0's process takes rank 1 on, its shard included), then
    node 0 with it: the last process takes ranks 0 and 1 on from the copies of both shards it held
    (the adopted shard was copied on like any other), and ends with the fault-free bits."""
    zero1 = tuple(o if o != "cluster.min_nodes=2" else "cluster.min_nodes=1" for o in ZERO)
    res = job(*zero1, "fault=kill_node", "fault.node=1", "fault.step=15", "fault.schedule=[{kind:kill_node,node:0,step:40}]", env=ENV)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["status"] == "completed" and len(s["faults_fired"]) == 2, s
    first, second = res.of("shrunk")
    assert (first["ranks"], second["ranks"], second["processes"]) == ([0, 2], [2], 1)
    assert s["final_state_sha256"] == baseline(*zero1, env=ENV)
    assert s["workers"] == "1/3 (degraded)"


def test_a_job_started_on_two_of_its_three_nodes_ends_with_the_three_node_bits(job, baseline):
    """cluster.start_nodes=2, parallel=zero (ddp starts through the same coordinator path, with
    less state): the job starts shrunk (the two started nodes train the third's rank too, and
    step its optimizer shard from the seeded init), a refill grows it to three once built, and
    it ends with the hash of the fault-free run of the whole layout."""
    cfg = ZERO
    res = job(*cfg, "cluster.start_nodes=2", "cluster.max_refills=1", "fault=none", env=ENV)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    (started,) = res.of("generation_started")
    assert sorted(int(r) for r in started["ranks"]) == [0, 1] and started["world"] == 3
    (grown,) = res.of("grown")
    assert grown["processes"] == 3 and s["workers"] == "3/3"
    (span,) = s["degraded"]["spans"]
    assert (span["from_step"], span["to_step"], span["processes"]) == (0, grown["step"], 2)
    assert s["final_state_sha256"] == baseline(*cfg, env=ENV)
