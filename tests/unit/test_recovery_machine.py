"""The recovery as a pure state machine (coordinator/recovery.py): typed messages and times in,
actions out; no sockets, no processes, no sleeps."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest

from ckptless_hpc.control import wire
from ckptless_hpc.control import messages
from ckptless_hpc.control.messages import Fetched, Held, Joining, Ready
from ckptless_hpc.coordinator.planner import MAX_SOURCES
from ckptless_hpc.coordinator.recovery import (
    Abort, Assign, Emit, Exclude, GiveUp, Lose, NewGeneration, Options, RecoveryMachine,
)
from ckptless_hpc.coordinator.sharding import Layout
from coordlib import cfg, membership

pytestmark = pytest.mark.timeout(60)

OPTS = Options(recovery_timeout_s=60.0, startup_timeout_s=300.0, heartbeat_timeout_s=3.0, heartbeat_interval_s=0.5)
T0 = 1000.0


class Job:
    """Membership of ``nodes`` x ``wpn`` ranks plus spare nodes, and a shell that carries out
    only what the machine's tests need (losses become failures, assigns adopt the ranks)."""

    def __init__(self, nodes: int, wpn: int, spare_nodes: int, *overrides: str) -> None:
        self.members = m = membership(nodes, wpn, spare_nodes)
        self.layout = Layout(cfg("task=mlp", f"cluster.nodes={nodes}", f"cluster.workers_per_node={wpn}", *overrides))
        self.failures: Dict[str, Tuple[str, float]] = {}
        self.machine = RecoveryMachine(m, self.layout, OPTS, gen=0)

    def fail(self, wid: str, t: float, why: str = "control connection closed (test)") -> None:
        self.members.lose(wid)
        self.failures[wid] = (why, t)

    def advance(self, now: float) -> List[Any]:
        failures, self.failures = self.failures, {}
        acts = self.machine.advance(now, failures)
        for a in acts:
            if isinstance(a, Lose):
                self.fail(a.worker, now, a.why)
            elif isinstance(a, Assign):
                self.members.assign(dict(a.ranks))
        return acts

    def hold_all(self, step: Any = 7) -> None:
        m = self.machine
        for w in self.members.survivors().values():
            m.on_message(w, Held(gen=m.gen - 1, abort_gen=m.gen, step=step(w) if callable(step) else step))

    def ready_all(self) -> None:
        for w in self.members.ranks.values():
            self.machine.on_message(w, Joining(gen=self.machine.gen))
            self.machine.on_message(w, Ready(gen=self.machine.gen))


def kinds(acts: List[Any]) -> List[str]:
    return [type(a).__name__ for a in acts]


def test_one_failure_goes_abort_held_plan_assign_ready_in_that_order():
    job = Job(nodes=2, wpn=2, spare_nodes=1)
    job.fail("n1.0", T0 - 0.5)
    acts = job.advance(T0)
    assert kinds(acts) == ["Exclude", "NewGeneration", "Emit", "Abort"]
    assert acts[0] == Exclude("n1", acts[0].why) and "n1.0" in acts[0].why
    assert acts[1] == NewGeneration(1) and acts[2].event == "generation_bumped"
    assert set(acts[3].workers) == {"n0.0", "n0.1", "n1.1"} and acts[3].gen == 1
    assert job.advance(T0 + 0.1) == [] and not job.machine.satisfied()  # waiting for the survivors

    job.machine.on_message("n0.0", Held(gen=0, abort_gen=0, step=7))  # answers an older abort: not this one
    job.machine.on_message("n0.1", Held(gen=0, abort_gen=1, step=7))
    assert job.advance(T0 + 0.2) == []
    job.hold_all(step=7)
    assert job.machine.satisfied()
    acts = job.advance(T0 + 0.3)
    assert kinds(acts) == ["Emit", "Assign", "ReleaseCommands"]  # the promotion is sent before the scheduler commands run
    assert acts[0].event == "spare_promoted" and acts[0].worker == "s0.0" and acts[0].fields == {"rank": 2, "step": 7}
    assign = acts[1]
    assert assign.step == 7 and assign.ranks[2] == "s0.0" and list(assign.sources) == ["s0.0"]
    assert job.advance(T0 + 0.4) == []

    job.machine.on_message("s0.0", Fetched(gen=1, source="n0.0", bytes=1000, seconds=0.25))
    job.ready_all()
    acts = job.advance(T0 + 0.5)
    assert kinds(acts) == ["Reformed"] and job.machine.done
    rec = acts[0].record
    assert (rec.gen, rec.failed_ranks, rec.failed_nodes, rec.replacements, rec.target_step) == (1, [2], ["n1"], {"2": "s0.0"}, 7)
    assert (rec.t_detect, rec.t_ready, rec.transfer_s, rec.bytes_transferred, rec.attempts) == (T0 - 0.5, T0 + 0.5, 0.25, 1000, 1)
    assert job.advance(T0 + 1) == []  # done: nothing more


def test_a_survivor_is_blamed_for_not_holding_only_at_the_deadline_then_the_next_generation_replaces_it():
    job = Job(nodes=3, wpn=1, spare_nodes=2)
    job.fail("n2.0", T0)
    job.advance(T0)
    job.machine.on_message("n0.0", Held(gen=0, abort_gen=1, step=3))
    assert job.advance(T0 + OPTS.recovery_timeout_s - 0.01) == []  # slow is not dead
    acts = job.advance(T0 + OPTS.recovery_timeout_s)
    assert acts == [Lose("n1.0", "did not hold within cluster.recovery_timeout_s=60s")]
    acts = job.advance(T0 + OPTS.recovery_timeout_s)  # the shell lost it: a failure of this recovery
    assert kinds(acts) == ["Exclude", "NewGeneration", "Emit", "Abort"] and acts[1] == NewGeneration(2)
    assert acts[3].workers == ("n0.0",)
    job.hold_all(step=3)
    acts = job.advance(T0 + 61)
    promoted = {a.fields["rank"]: a.worker for a in acts if isinstance(a, Emit)}
    assert promoted == {1: "s0.0", 2: "s1.0"}
    job.ready_all()
    rec = job.advance(T0 + 62)[0].record
    assert rec.failed_ranks == [1, 2] and rec.attempts == 2 and rec.failed_workers == ["n2.0", "n1.0"] and rec.gen == 2


def test_a_failure_during_forming_starts_the_next_generation_with_both_failures():
    job = Job(nodes=2, wpn=2, spare_nodes=2)
    job.fail("n1.0", T0)
    job.advance(T0)
    job.hold_all()
    assert kinds(job.advance(T0 + 1)) == ["Emit", "Assign", "ReleaseCommands"]
    job.fail("n0.1", T0 + 2)  # a survivor dies while the generation forms
    acts = job.advance(T0 + 2)
    assert kinds(acts) == ["Exclude", "NewGeneration", "Emit", "Abort"] and acts[1] == NewGeneration(2)
    assert set(acts[3].workers) == {"n0.0", "n1.1", "s0.0"}  # the promoted spare is a survivor now
    job.hold_all(step=lambda w: None if w == "s0.0" else 7)  # the spare never got the state
    acts = job.advance(T0 + 3)
    assign = next(a for a in acts if isinstance(a, Assign))
    assert assign.ranks[1] not in ("n0.1", "s0.0") and assign.ranks[2] == "s0.0"
    assert set(assign.sources) == {"s0.0", assign.ranks[1]}  # both replacements fetch; the survivors do not
    job.ready_all()
    rec = job.advance(T0 + 4)[0].record
    assert rec.failed_ranks == [1, 2] and rec.attempts == 2 and rec.failed_nodes == ["n0", "n1"]


def test_a_replacement_that_cannot_start_is_replanned_at_once_and_lost_the_third_time():
    job = Job(nodes=2, wpn=1, spare_nodes=2)
    job.fail("n1.0", T0)
    job.advance(T0)
    for attempt in range(1, 4):
        job.hold_all(step=lambda w: None if w == "s0.0" else 5)
        acts = job.advance(T0 + attempt)
        assert any(isinstance(a, Assign) and a.ranks[1] == "s0.0" for a in acts)
        job.machine.on_start_failed("s0.0", job.machine.gen - 1, "start failed: an older generation's report")  # not this one
        assert job.advance(T0 + attempt) == []
        job.machine.on_start_failed("s0.0", job.machine.gen, "start failed: no copy matched its checksum")
        assert job.machine.satisfied()
        acts = job.advance(T0 + attempt)
        if attempt < 3:
            assert acts == []  # nobody blamed yet: the next generation is due at once
            assert kinds(job.advance(T0 + attempt)) == ["NewGeneration", "Emit", "Abort"]
        else:
            assert acts == [Lose("s0.0", "could not start 3 generations in a row: start failed: no copy matched its checksum")]
    acts = job.advance(T0 + 4)
    assert kinds(acts) == ["Exclude", "NewGeneration", "Emit", "Abort"] and acts[0].node == "s0"
    job.hold_all(step=5)
    assert next(a for a in job.advance(T0 + 5) if isinstance(a, Assign)).ranks[1] == "s1.0"


def test_a_start_that_failed_on_its_sources_counts_against_the_sources_not_the_replacement():
    """The spare reports that its fetch failed at the source it names (unreachable, refused):
    three such generations lose the source, never the spare (which reached the coordinator to
    say so), and the spare keeps its rank."""
    job = Job(nodes=3, wpn=1, spare_nodes=2)
    job.fail("n2.0", T0)
    job.advance(T0)
    for attempt in range(1, 4):
        job.hold_all(step=lambda w: None if w == "s0.0" else 5)
        acts = job.advance(T0 + attempt)
        (assign,) = [a for a in acts if isinstance(a, Assign)]
        assert assign.ranks[2] == "s0.0" and assign.sources["s0.0"][0] == "n0.0"
        job.machine.on_start_failed("s0.0", job.machine.gen, "start failed: cannot reach state source", blame=["n0.0", "nobody.0"])
        acts = job.advance(T0 + attempt)
        if attempt < 3:
            assert acts == [] and kinds(job.advance(T0 + attempt)) == ["NewGeneration", "Emit", "Abort"]
        else:
            assert acts == [Lose("n0.0", "could not serve its state to s0.0 in 3 generations: start failed: cannot reach state source")]
    acts = job.advance(T0 + 4)
    assert [a.node for a in acts if isinstance(a, Exclude)] == ["n0"]  # the source's node, not the spare's
    job.hold_all(step=lambda w: None if w == "s0.0" else 5)
    assign = next(a for a in job.advance(T0 + 5) if isinstance(a, Assign))
    assert assign.ranks[2] == "s0.0" and assign.ranks[0] == "s1.0" and assign.sources["s0.0"] == ["n1.0"]


def test_forming_out_of_time_blames_only_who_never_joined():
    job = Job(nodes=2, wpn=2, spare_nodes=1)
    job.fail("n1.0", T0)
    job.advance(T0)
    job.hold_all()
    job.advance(T0 + 1)
    for w in ("n0.0", "n0.1", "n1.1"):
        job.machine.on_message(w, Joining(gen=1))
    assert job.advance(T0 + 1 + OPTS.recovery_timeout_s - 0.01) == []
    acts = job.advance(T0 + 1 + OPTS.recovery_timeout_s)
    assert acts == [Lose("s0.0", "did not join generation 1 within 60s")]


def test_no_spare_left_gives_up_with_the_steps_held():
    job = Job(nodes=2, wpn=2, spare_nodes=0)
    job.fail("n1.0", T0)
    job.advance(T0)
    job.hold_all(step=lambda w: 9 if w == "n0.0" else 8)
    acts = job.advance(T0 + 1)
    assert kinds(acts) == ["Emit", "ReleaseCommands", "GiveUp"] and acts[0].event == "no_spare"
    give_up = acts[2]
    assert isinstance(give_up, GiveUp) and not give_up.state_lost and "no spare left" in give_up.reason
    assert give_up.held_steps == {"n0.0": 9, "n0.1": 8, "n1.1": 8} and job.machine.done


def test_a_mass_failure_at_10k_ranks_is_one_generation_with_small_assigns():
    wpn, nodes, lost_nodes = 8, 1250, 50
    job = Job(nodes=nodes, wpn=wpn, spare_nodes=lost_nodes)
    for n in range(0, nodes, nodes // lost_nodes):  # every 25th node at once
        for j in range(wpn):
            job.fail(f"n{n}.{j}", T0)
    acts = job.advance(T0)
    assert kinds(acts).count("NewGeneration") == 1 and kinds(acts).count("Exclude") == lost_nodes * wpn
    abort = next(a for a in acts if isinstance(a, Abort))
    assert len(abort.workers) == (nodes - lost_nodes) * wpn
    job.hold_all(step=lambda w: 11 if int(w[1:].split(".")[0]) % 2 else 10)  # half a step behind
    acts = job.advance(T0 + 1)
    assign = next(a for a in acts if isinstance(a, Assign))
    promoted = [a for a in acts if isinstance(a, Emit) and a.event == "spare_promoted"]
    assert len(promoted) == lost_nodes * wpn and {a.worker.split(".")[0] for a in promoted} == {f"s{i}" for i in range(lost_nodes)}
    assert assign.step == 11 and len(assign.ranks) == nodes * wpn
    assert all(1 <= len(s) <= MAX_SOURCES for s in assign.sources.values())
    ends = {w: ("10.0.0.1", 40000) for w in job.members.workers}
    biggest = max(len(wire.encode(messages.assign(1, r, nodes * wpn, 11, assign.sources.get(w, ()), ends, list(range(50)))))
                  for r, w in assign.ranks.items())
    assert biggest < 4096  # bounded whatever the world size: a few sources, never every survivor
    job.ready_all()
    rec = job.advance(T0 + 2)[0].record
    assert len(rec.failed_ranks) == lost_nodes * wpn and rec.attempts == 1 and len(rec.replacements) == lost_nodes * wpn


def test_sharded_state_assigns_only_once_the_promoted_spare_serves_or_its_start_up_time_is_over():
    for built_in_time in (True, False):
        job = Job(2, 1, 1, "parallel=zero")
        spare = job.members.workers["s0.0"]
        spare.built = False  # still importing torch, building its model
        job.fail("n1.0", T0)
        job.advance(T0)
        job.machine.on_message("n0.0", Held(gen=0, abort_gen=1, step=5, inventory={"0": [4, 5], "1": [5]}))  # its shard and rank 1's copy
        acts = job.advance(T0 + 1)
        assert kinds(acts) == ["Emit"] and acts[0].event == "spare_promoted" and not job.machine.satisfied()
        if built_in_time:
            spare.built = True
            assert job.machine.satisfied()
            now = T0 + 2
        else:
            assert job.advance(T0 + 1 + OPTS.startup_timeout_s - 0.01) == []
            now = T0 + 1 + OPTS.startup_timeout_s
        acts = job.advance(now)
        assert kinds(acts) == ["Assign", "ReleaseCommands"]
        assert acts[0].step == 5 and acts[0].ranks == {0: "n0.0", 1: "s0.0"} and acts[0].sources == {"s0.0": ["n0.0"]}


def test_a_node_lost_rank_by_rank_is_one_generation_that_replaces_all_its_ranks():
    """kill_node: the node's workers die together and are seen one by one, 14 ms apart. The
    second loss, seen while the survivors hold, folds into the generation being held."""
    job = Job(nodes=2, wpn=2, spare_nodes=1)
    job.fail("n1.0", T0)
    acts = job.advance(T0)
    assert kinds(acts) == ["Exclude", "NewGeneration", "Emit", "Abort"] and acts[1] == NewGeneration(1)
    job.machine.on_message("n1.1", Held(gen=0, abort_gen=1, step=7))  # it held, then its node went
    job.fail("n1.1", T0 + 0.014)
    acts = job.advance(T0 + 0.014)
    assert kinds(acts) == ["Emit"] and acts[0].event == "failure_folded", acts
    assert acts[0].fields == {"failed_ranks": [3], "nodes": ["n1"], "survivors": 2}
    assert job.machine.gen == 1 and not job.machine.satisfied()
    job.machine.on_message("n0.0", Held(gen=0, abort_gen=1, step=7))
    assert not job.machine.satisfied()  # n0.1 still holds; the dead n1.1 is not waited for
    job.machine.on_message("n0.1", Held(gen=0, abort_gen=1, step=7))
    acts = job.advance(T0 + 0.1)
    assert kinds(acts) == ["Emit", "Emit", "Assign", "ReleaseCommands"]
    assert {a.fields["rank"]: a.worker for a in acts[:2]} == {2: "s0.0", 3: "s0.1"}  # one spare node for one lost node
    assign = acts[2]
    assert assign.ranks == {0: "n0.0", 1: "n0.1", 2: "s0.0", 3: "s0.1"} and set(assign.sources) == {"s0.0", "s0.1"}
    assert all("n1.1" not in s for s in assign.sources.values())  # a dead worker's hold is no source
    job.ready_all()
    (done,) = job.advance(T0 + 0.2)
    rec = done.record
    assert (rec.gen, rec.attempts, rec.failed_ranks, rec.failed_nodes, rec.failed_workers) == (1, 1, [2, 3], ["n1"], ["n1.0", "n1.1"])
    assert rec.t_detect == T0 and rec.replacements == {"2": "s0.0", "3": "s0.1"}


def _node_lost_after_one_held() -> Job:
    """Node n1 lost, no spare: n1.0 first, then n1.1 (after it held step 9), folded in at T0 + 1."""
    job = Job(nodes=2, wpn=2, spare_nodes=0)
    job.fail("n1.0", T0)
    job.advance(T0)
    job.machine.on_message("n1.1", Held(gen=0, abort_gen=1, step=9))
    job.fail("n1.1", T0 + 1)
    assert kinds(job.advance(T0 + 1)) == ["Emit"]
    return job


def test_a_folded_loss_keeps_the_hold_deadline_and_its_hold_is_not_counted():
    job = _node_lost_after_one_held()
    job.machine.on_message("n0.0", Held(gen=0, abort_gen=1, step=8))
    assert job.advance(T0 + OPTS.recovery_timeout_s - 0.01) == []
    assert job.advance(T0 + OPTS.recovery_timeout_s) == [Lose("n0.1", "did not hold within cluster.recovery_timeout_s=60s")]
    job2 = _node_lost_after_one_held()
    job2.hold_all(step=8)
    give_up = job2.advance(T0 + 2)[-1]
    assert isinstance(give_up, GiveUp) and give_up.held_steps == {"n0.0": 8, "n0.1": 8}  # never the dead worker's step 9
    assert "2 rank(s) [2, 3] failed" in give_up.reason


@pytest.mark.parametrize("late", ["another node, while the survivors hold", "the same node, once the plan is sent"])
def test_a_loss_that_is_not_the_same_failure_starts_the_next_generation(late):
    job = Job(nodes=3, wpn=2, spare_nodes=2)
    job.fail("n1.0", T0)
    job.advance(T0)
    if late.startswith("the same node"):
        job.hold_all()
        assert kinds(job.advance(T0 + 1)) == ["Emit", "Assign", "ReleaseCommands"]  # n1.1 named a survivor
        job.fail("n1.1", T0 + 2)
    else:
        job.fail("n2.0", T0 + 0.01)
    acts = job.advance(T0 + 2)
    assert kinds(acts) == ["Exclude", "NewGeneration", "Emit", "Abort"] and acts[1] == NewGeneration(2), late
