"""Planned moves as pure decisions (coordinator/moves.py) and as the job machine carries them
out (job.py, recovery.py planned): a drain, a straggler, a grow-back at a step boundary; only
``now`` and the steps heard of move. No sockets, no processes, no sleeps."""

from __future__ import annotations

from typing import Any, List

import pytest

from ckptless_hpc.control.messages import Held, Joining, Ready
from ckptless_hpc.coordinator.job import Inputs, JobMachine, Options, Phase, StartTraining
from ckptless_hpc.coordinator.moves import DRAIN, STRAGGLER, MoveRules, boundary_step
from ckptless_hpc.coordinator.recovery import Options as RecoveryOptions
from ckptless_hpc.coordinator.sharding import Layout
from coordlib import carry_out, cfg, membership

pytestmark = pytest.mark.timeout(60)

REC = RecoveryOptions(recovery_timeout_s=60.0, startup_timeout_s=300.0, heartbeat_timeout_s=3.0, heartbeat_interval_s=0.5)
T0 = 1000.0


def training(nodes: int = 2, spare_nodes: int = 1, wpn: int = 1, steps: int = 1000, *overrides: str) -> JobMachine:
    m = membership(nodes, wpn, spare_nodes)
    layout = Layout(cfg("task=mlp", f"cluster.nodes={nodes}", f"cluster.workers_per_node={wpn}", *overrides))
    job = JobMachine(m, layout, nodes * wpn, Options(300.0, True, spare_nodes, REC, total_steps=steps))
    assert job.advance(T0, Inputs(built=True))[0] == [StartTraining()]
    return job


def kinds(acts: List[Any]) -> List[str]:
    return [type(a).__name__ for a in acts]


def of(acts: List[Any], kind: str) -> List[Any]:
    return [a for a in acts if type(a).__name__ == kind]


def events(acts: List[Any], name: str) -> List[Any]:
    return [a.fields for a in of(acts, "Emit") if a.event == name]


def hold_all(job: JobMachine, step: int, workers: Any = None) -> None:
    for w in workers if workers is not None else of_abort(job):
        job.held(w, job.members.workers[w].role, Held(gen=job.gen - 1, abort_gen=job.gen, step=step))


def of_abort(job: JobMachine) -> List[str]:
    return [w for w in job.members.workers if job.members.workers[w].role in ("active", "leaving") and job.members.workers[w].rank is not None]


def form(job: JobMachine, t: float) -> List[Any]:
    for w in job.members.ranks.values():
        job.recovery.on_message(w, Joining(gen=job.gen))
        job.recovery.on_message(w, Ready(gen=job.gen))
    acts, _ = job.advance(t)
    carry_out(job, acts)
    return acts


# ---------------------------------------------------------------- the boundary
def test_the_boundary_is_ahead_by_at_least_two_steps_and_half_a_second_of_steps():
    assert boundary_step(10, None, 1000) == 12  # step time unknown: the margin in steps
    assert boundary_step(10, 1.0, 1000) == 12  # slow steps: two of them
    assert boundary_step(10, 0.1, 1000) == 15  # fast steps: 0.5 s of them
    assert boundary_step(10, 0.001, 1000) == 510
    assert boundary_step(10, 0.1, 15) is None and boundary_step(10, 0.1, 16) == 15  # the job ends first: no move


# ---------------------------------------------------------------- the rules
def test_a_drain_of_a_node_the_job_does_not_train_on_is_refused_with_its_nodes():
    rules = MoveRules()
    assert rules.ask("n9", DRAIN, "maintenance", {"n0", "n1"}, set()) == "node n9 holds no rank of this job (its nodes: n0, n1)"
    assert rules.ask("n1", DRAIN, "maintenance", {"n0"}, {"n1"}) == "node n1 is excluded already"
    assert rules.wanted == {}


def test_a_drain_outranks_a_straggler_request_and_moves_go_as_far_as_spare_nodes():
    rules = MoveRules()
    for node, kind in (("n2", STRAGGLER), ("n1", STRAGGLER), ("n2", DRAIN), ("n0", DRAIN)):
        assert rules.ask(node, kind, "why", {"n0", "n1", "n2"}, set()) is None
    assert rules.wanted["n2"].kind == DRAIN
    needed = {"n0": 1, "n1": 1, "n2": 1}
    assert [r.node for r in rules.due(2, needed)] == ["n0", "n2"]  # drains first, by node; one spare node each
    assert rules.due(0, needed) == []  # no spare: they wait, reported
    assert rules.ask("n2", STRAGGLER, "slow", {"n2"}, set()) is None and rules.wanted["n2"].kind == DRAIN  # a straggler never replaces a drain


def test_a_rank_moved_for_straggling_is_not_blamed_again():
    rules = MoveRules()
    assert rules.straggler(3, "n1", 3.2, 8) == ("n1", "rank 3 straggled: 3.2x slower than the typical rank over 8 steps")
    rules.ask("n1", STRAGGLER, "slow", {"n1"}, set())
    rules.taken(rules.due(1, {"n1": 1}), {"n1": [3]})
    assert rules.wanted == {} and rules.straggler(3, "s0", 3.0, 8) is None  # slow on the spare too: the slowness went with the rank


# ---------------------------------------------------------------- the machine
def test_a_drained_node_hands_its_rank_to_a_spare_at_the_boundary_and_no_step_is_redone():
    job = training(2, 1)
    assert job.request_move("n1", DRAIN, "maintenance") is None
    assert not job.poll_moves()  # no step heard of yet: no boundary
    job.committed(10, 0.1)
    assert not job.attention()  # attention() is O(1) after every wake-up: the move waits for the heartbeat's poll
    assert job.poll_moves() and job.attention()
    acts, _ = job.advance(T0 + 1)
    carry_out(job, acts)
    assert kinds(acts) == ["NewGeneration", "Emit", "Abort"] and job.phase is Phase.RECOVERING
    abort = of(acts, "Abort")[0]
    assert abort.at_step == 15 and sorted(abort.workers) == ["n0.0", "n1.0"]  # the leaving worker holds too: it serves its state
    assert events(acts, "move_planned") == [{"kind": "drain", "step": 15, "nodes": ["n1"], "ranks": [1], "reason": "node n1: maintenance"}]
    assert job.members.workers["n1.0"].role == "leaving" and job.moves.wanted == {}
    assert job.advance(T0 + 1.5)[0] == []  # waiting for the ranks to reach the boundary
    hold_all(job, 15)
    acts, _ = job.advance(T0 + 2)
    carry_out(job, acts)
    assign = of(acts, "Assign")[0]
    assert assign.step == 15 and dict(assign.ranks) == {0: "n0.0", 1: "s0.0"}  # the boundary itself: nothing rolled back or redone
    assert assign.sources == {"s0.0": ["n0.0"]}
    acts = form(job, T0 + 3)
    assert kinds(acts) == ["Release", "Exclude", "Reformed", "LeaveRecovery"]
    rec = of(acts, "Reformed")[0].record
    assert rec.planned == {"kind": "drain", "step": 15, "reason": "node n1: maintenance"} and rec.target_step == 15
    assert rec.t_fail == T0 + 2 and rec.failed_ranks == [1]  # the downtime counts from the boundary, not from the request
    assert of(acts, "Release")[0].workers == ("n1.0",) and of(acts, "Exclude")[0].node == "n1"
    assert job.members.workers["n1.0"].role == "dead" and job.phase is Phase.TRAINING and job.refills() == 1


def test_a_drain_waits_for_a_built_spare_then_moves():
    job = training(2, 0)
    job.committed(10, 0.1)
    assert job.request_move("n0", DRAIN, "maintenance") is None
    assert not job.poll_moves() and job.advance(T0 + 1)[0] == []  # no spare: it waits (a crash would be a recovery)
    job.members.add_node("s9", "spare")
    assert not job.poll_moves()  # not built yet
    job.members.workers["s9.0"].built = True
    assert job.poll_moves()
    acts, _ = job.advance(T0 + 2)
    assert of(acts, "Abort")[0].at_step == 15 and job.members.workers["n0.0"].role == "leaving"


def test_a_move_is_not_planned_when_the_job_ends_first_and_never_spins():
    job = training(2, 1, 1, 20)
    job.committed(18, 0.1)
    job.request_move("n1", DRAIN, "maintenance")
    assert not job.poll_moves() and job.advance(T0 + 1)[0] == []


def test_a_failure_while_the_ranks_go_to_the_boundary_calls_the_move_off_for_an_ordinary_recovery():
    job = training(3, 1)
    job.committed(10, 0.1)
    job.request_move("n2", DRAIN, "maintenance")
    assert job.poll_moves()  # the heartbeat's poll finds it due
    carry_out(job, job.advance(T0 + 1)[0])
    job.lost("n0.0", job.members.lose("n0.0"), "killed (test)", T0 + 1.2)  # a survivor dies before the boundary
    acts, _ = job.advance(T0 + 1.3)
    carry_out(job, acts)
    abort = of(acts, "Abort")[0]
    assert abort.at_step is None and sorted(abort.workers) == ["n1.0", "n2.0"]  # abort now; the leaving worker keeps its rank
    rec = job.recovery.record
    assert rec.planned is None and rec.t_fail == T0 + 1.2 and rec.failed_ranks == [0]  # the failure's own record
    hold_all(job, 13, ["n1.0", "n2.0"])
    acts, _ = job.advance(T0 + 2)
    carry_out(job, acts)
    assert dict(of(acts, "Assign")[0].ranks) == {0: "s0.0", 1: "n1.0", 2: "n2.0"}  # the one spare took the failed rank
    acts = form(job, T0 + 3)
    assert kinds(acts) == ["Reformed", "LeaveRecovery"]
    assert list(job.moves.wanted) == ["n2"]  # asked again: it moves once a spare is built
    job.committed(20, 0.1)
    assert not job.poll_moves()  # no spare left


def test_a_move_whose_spare_went_meanwhile_re_forms_in_place_and_is_asked_again():
    job = training(2, 1)
    job.committed(10, 0.1)
    job.request_move("n1", DRAIN, "maintenance")
    assert job.poll_moves()  # the heartbeat's poll finds it due
    carry_out(job, job.advance(T0 + 1)[0])
    job.members.workers["s0.0"].role = "dead"  # the spare died while the ranks went to the boundary
    hold_all(job, 15)
    acts, _ = job.advance(T0 + 2)
    carry_out(job, acts)
    assert of(acts, "GiveUp") == [] and dict(of(acts, "Assign")[0].ranks) == {0: "n0.0", 1: "n1.0"}
    acts = form(job, T0 + 3)
    assert kinds(acts) == ["Reformed", "LeaveRecovery"]  # nothing released, no node excluded
    assert of(acts, "Reformed")[0].record.planned["called_off"].startswith("no spare left")
    assert list(job.moves.wanted) == ["n1"]


def test_a_straggler_request_drops_when_its_node_failed_meanwhile():
    job = training(2, 1)
    job.committed(10, 0.1)
    job.request_move("n1", STRAGGLER, "slow")
    job.lost("n1.0", job.members.lose("n1.0"), "killed (test)", T0 + 1)
    acts, _ = job.advance(T0 + 1.1)
    carry_out(job, acts)
    assert of(acts, "Abort")[0].at_step is None  # the failure is recovered from as usual
    hold_all(job, 11, ["n0.0"])
    carry_out(job, job.advance(T0 + 2)[0])
    form(job, T0 + 3)
    job.members.add_node("s1", "spare")
    job.members.workers["s1.0"].built = True
    assert not job.poll_moves() and job.moves.wanted == {}  # its rank is on the spare now: nothing to move


def adopted_drain(job: JobMachine) -> JobMachine:
    """A drain of n1 planned at step 15, every rank held there, its plan adopted (a spare has rank 1)."""
    job.committed(10, 0.1)
    job.request_move("n1", DRAIN, "maintenance")
    assert job.poll_moves()  # the heartbeat's poll finds it due
    carry_out(job, job.advance(T0 + 1)[0])
    hold_all(job, 15)
    carry_out(job, job.advance(T0 + 2)[0])
    return job


def test_the_spare_dying_after_it_took_the_rank_gives_the_rank_back_to_the_leaving_worker():
    """A failure after the plan was adopted: the incoming spare dies while the group forms. The
    leaving worker still holds the rank's state at the boundary: the rank goes back to it (no
    give-up for want of a spare, nothing rolled back), and the move is asked again."""
    job = adopted_drain(training(2, 1))
    assert dict(job.members.ranks) == {0: "n0.0", 1: "s0.0"}  # adopted: the spare has rank 1
    job.lost("s0.0", job.members.lose("s0.0"), "killed (test)", T0 + 2.5)
    acts, _ = job.advance(T0 + 2.6)
    carry_out(job, acts)
    assert sorted(of(acts, "Abort")[0].workers) == ["n0.0", "n1.0"] and job.members.workers["n1.0"].role == "active"
    hold_all(job, 15, ["n0.0", "n1.0"])
    acts, _ = job.advance(T0 + 3)
    carry_out(job, acts)
    assert of(acts, "GiveUp") == [] and dict(of(acts, "Assign")[0].ranks) == {0: "n0.0", 1: "n1.0"}
    assert of(acts, "Assign")[0].step == 15  # the boundary: nothing redone
    acts = form(job, T0 + 4)
    assert kinds(acts) == ["Reformed", "LeaveRecovery"]  # nothing released, no node excluded
    assert list(job.moves.wanted) == ["n1"]


def test_a_survivor_dying_after_the_spare_took_the_rank_keeps_the_move():
    """A survivor dies after the plan was adopted: the move stands (the spare has the moved rank),
    the failed rank goes to the second spare, and the leaving worker serves, then is released."""
    job = adopted_drain(training(2, 2))
    promoted = job.members.ranks[1]
    job.lost("n0.0", job.members.lose("n0.0"), "killed (test)", T0 + 2.5)
    acts, _ = job.advance(T0 + 2.6)
    carry_out(job, acts)
    assert sorted(of(acts, "Abort")[0].workers) == sorted([promoted, "n1.0"])  # the leaving worker still holds (it may serve)
    assert job.members.workers["n1.0"].role == "leaving"
    hold_all(job, 15, [promoted, "n1.0"])
    acts, _ = job.advance(T0 + 3)
    carry_out(job, acts)
    ranks = dict(of(acts, "Assign")[0].ranks)
    assert ranks[1] == promoted and ranks[0] not in ("n0.0", "n1.0", promoted) and of(acts, "Assign")[0].step == 15
    acts = form(job, T0 + 4)
    assert kinds(acts) == ["Release", "Exclude", "Reformed", "LeaveRecovery"]
    assert of(acts, "Release")[0].workers == ("n1.0",) and of(acts, "Exclude")[0].node == "n1"
    assert job.members.workers["n1.0"].role == "dead" and job.moves.wanted == {}


def test_a_shrunk_job_grows_back_before_it_drains_and_drains_on_the_next_spare():
    """A rank without a process of its own is worse than a node to drain: with one built spare, a
    shrunk job grows back first; the drain, asked meanwhile, waits for the next spare."""
    elastic = RecoveryOptions(60.0, 300.0, 3.0, 0.5, min_nodes=2, world=3)
    m = membership(3, 1, 0)
    job = JobMachine(m, Layout(cfg("task=mlp", "cluster.nodes=3")), 3, Options(300.0, True, 0, elastic, total_steps=1000))
    job.advance(T0, Inputs(built=True))
    job.lost("n2.0", m.lose("n2.0"), "killed (test)", T0 + 1)
    carry_out(job, job.advance(T0 + 1)[0])
    hold_all(job, 7, ["n0.0", "n1.0"])
    carry_out(job, job.advance(T0 + 1.1)[0])
    form(job, T0 + 1.2)
    assert job.vacant == 1  # shrunk: rank 2 trained by the survivors
    m.add_node("r0", "spare")
    m.workers["r0.0"].built = True
    job.committed(9, 0.1)
    assert job.request_move("n0", DRAIN, "maintenance") is None
    assert job.poll_moves()
    acts, _ = job.advance(T0 + 2)
    carry_out(job, acts)
    assert [e["kind"] for e in events(acts, "move_planned")] == ["grow"] and list(job.moves.wanted) == ["n0"]
    hold_all(job, 14, ["n0.0", "n1.0"])
    carry_out(job, job.advance(T0 + 2.1)[0])
    form(job, T0 + 2.2)
    assert job.vacant == 0 and job.members.ranks[2] == "r0.0"
    job.committed(20, 0.1)
    assert not job.poll_moves()  # no spare left for the drain: it waits
    m.add_node("r1", "spare")
    m.workers["r1.0"].built = True
    assert job.poll_moves()
    acts, _ = job.advance(T0 + 3)
    assert [e["kind"] for e in events(acts, "move_planned")] == ["drain"] and of(acts, "Abort")[0].at_step == 25
