"""The job's lifecycle as a pure machine (coordinator/job.py): inputs and times in, actions and a
reason out; only ``now`` moves. No sockets, no processes, no sleeps."""

from __future__ import annotations

from typing import Any, List

import pytest

from ckptless_hpc.control.messages import Done, Held, Joining, Ready
from ckptless_hpc.coordinator.job import Complete, Finish, Inputs, JobMachine, LeaveRecovery, Options, Phase, SaveAndRequeue, StartTraining, StopNonfinite
from ckptless_hpc.coordinator.membership import FATAL_AT_STARTUP, RECOVER, SPARE_LOST
from ckptless_hpc.coordinator.recovery import Options as RecoveryOptions, Reformed
from ckptless_hpc.coordinator.sharding import Layout
from ckptless_hpc.coordinator.verdicts import EXIT_CANCELLED, EXIT_FAILED, EXIT_STARTUP
from ckptless_hpc.faults import Fault
from coordlib import carry_out, cfg, membership

pytestmark = pytest.mark.timeout(60)

REC = RecoveryOptions(recovery_timeout_s=60.0, startup_timeout_s=300.0, heartbeat_timeout_s=3.0, heartbeat_interval_s=0.5)
T0 = 1000.0


def machine(nodes: int = 2, wpn: int = 1, spare_nodes: int = 1, refill: bool = True, faults: Any = ()) -> JobMachine:
    m = membership(nodes, wpn, spare_nodes)
    layout = Layout(cfg("task=mlp", f"cluster.nodes={nodes}", f"cluster.workers_per_node={wpn}"))
    return JobMachine(m, layout, nodes * wpn, Options(300.0, refill, spare_nodes, REC), faults)


def training(nodes: int = 2, **kw: Any) -> JobMachine:
    job = machine(nodes, **kw)
    acts, _ = job.advance(T0, Inputs(built=True))
    assert acts == [StartTraining()] and job.phase is Phase.TRAINING and job.gen == 0
    return job


def kinds(acts: List[Any]) -> List[str]:
    return [type(a).__name__ for a in acts]


def lose(job: JobMachine, wid: str, t: float) -> str:
    return job.lost(wid, job.members.lose(wid), "control connection closed (test)", t)


def test_start_up_out_of_time_names_who_did_not_start_and_ends_the_job():
    job = machine()
    acts, why = job.advance(T0, Inputs(built=False, missing=["n1.0"]))
    assert acts == [Finish(EXIT_STARTUP, "startup_failed", "workers ['n1.0'] did not start within cluster.startup_timeout_s=300.0s")]
    assert job.phase is Phase.ENDED and job.stopping and why == "start-up failed"


def test_a_cancel_wins_over_everything_at_start_up_and_in_training():
    job = machine()
    job.cancel_requested = "cancelled by SIGTERM"
    assert job.advance(T0, Inputs(built=True))[0] == [Finish(EXIT_CANCELLED, "cancelled", "cancelled by SIGTERM")]
    job = training()
    job.fail("boom")
    job.cancel_requested = "cancelled by SIGINT"
    assert job.advance(T0 + 1)[0] == [Finish(EXIT_CANCELLED, "cancelled", "cancelled by SIGINT")]


def test_a_loss_before_training_is_fatal_and_the_first_error_is_the_one_reported():
    job = machine()
    assert lose(job, "n1.0", T0) == FATAL_AT_STARTUP and not job.pending
    job.fail("first")
    job.fail("second")
    assert job.advance(T0 + 1, Inputs(built=True))[0] == [Finish(EXIT_STARTUP, "startup_failed", "first")]


def test_training_waits_with_nothing_to_decide_then_completes_once_every_rank_is_done():
    job = training()
    assert job.advance(T0 + 1) == ([], "training") and not job.attention()
    for w in job.members.ranks.values():
        job.g(0).done[w] = Done(gen=0, sha256="x")
    assert job.attention() and job.advance(T0 + 2)[0] == [Complete()] and job.phase is Phase.SAVING


def test_a_fatal_error_in_training_fails_the_job():
    job = training()
    job.fail("the requeued job cannot resume: bad file")
    assert job.advance(T0 + 1)[0] == [Finish(EXIT_FAILED, "failed", "the requeued job cannot resume: bad file")]


def test_a_save_request_saves_and_requeues_unless_training_is_done():
    job = training()
    job.save_requested = "Slurm warning signal"
    assert job.advance(T0 + 1)[0] == [SaveAndRequeue("Slurm warning signal")] and job.phase is Phase.SAVING
    job = training()
    for w in job.members.ranks.values():
        job.g(0).done[w] = Done(gen=0, sha256="x")
    job.save_requested = "Slurm warning signal"
    assert job.advance(T0 + 1)[0] == [Complete()]


def test_a_non_finite_step_stops_the_job_but_a_pending_failure_is_recovered_first():
    job = training(spare_nodes=1)
    job.nonfinite = {"step": 3, "loss": "nan"}
    assert lose(job, "n1.0", T0 + 1) == RECOVER
    acts, _ = job.advance(T0 + 1)
    assert job.phase is Phase.RECOVERING and kinds(acts) == ["Exclude", "NewGeneration", "Emit", "Abort"]
    job = training()
    job.nonfinite = {"step": 3, "loss": "nan"}
    assert job.advance(T0 + 1)[0] == [StopNonfinite({"step": 3, "loss": "nan"})] and job.phase is Phase.SAVING


def test_one_failure_is_recovered_inside_the_machine_and_training_goes_on():
    job = training(spare_nodes=1)
    lose(job, "n1.0", T0 + 1)
    acts, _ = job.advance(T0 + 1)
    carry_out(job, acts)
    assert job.gen == 1 and not job.pending and job.recovery is not None
    assert job.advance(T0 + 1.1)[0] == [] and not job.recovery_settled()
    job.held("n0.0", "active", Held(gen=0, abort_gen=1, step=5))
    assert job.recovery_settled() and job.g(1).held["n0.0"].step == 5
    acts, _ = job.advance(T0 + 1.2)
    carry_out(job, acts)
    assert kinds(acts) == ["Emit", "Assign", "ReleaseCommands"]
    for w in job.members.ranks.values():
        job.recovery.on_message(w, Joining(gen=1))
        job.recovery.on_message(w, Ready(gen=1))
    acts, reason = job.advance(T0 + 1.5)
    assert kinds(acts) == ["Reformed", "LeaveRecovery"] and reason == "re-formed"
    assert isinstance(acts[0], Reformed) and acts[0].record.target_step == 5
    assert job.phase is Phase.TRAINING and job.recovery is None and job.advance(T0 + 2) == ([], "training")


def test_no_spare_left_gives_up_at_the_deadline_and_saves_what_the_survivors_hold():
    job = training(nodes=2, spare_nodes=0)
    lose(job, "n1.0", T0 + 1)
    carry_out(job, job.advance(T0 + 1)[0])
    job.held("n0.0", "active", Held(gen=0, abort_gen=1, step=9))
    acts, reason = job.advance(T0 + 1.1)
    assert kinds(acts)[-2:] == ["SaveAndRequeue", "LeaveRecovery"] and job.phase is Phase.SAVING
    save = acts[-2]
    assert save.survivors == {0: "n0.0"} and save.held == {"n0.0": 9} and not save.state_lost and save.reason == reason


def test_a_recovery_out_of_time_moves_on_at_its_deadline_only_when_told_so():
    job = training(nodes=3, spare_nodes=1)
    lose(job, "n2.0", T0)
    carry_out(job, job.advance(T0)[0])
    job.held("n0.0", "active", Held(gen=0, abort_gen=1, step=3))
    assert job.advance(T0 + 1)[0] == []
    acts, _ = job.advance(T0 + 1, Inputs(timed_out=True))  # the deadline passed while the shell waited
    assert [a.worker for a in acts] == ["n1.0"]


def test_a_cancel_during_a_recovery_ends_the_job_and_releases_the_commands():
    job = training()
    lose(job, "n1.0", T0)
    carry_out(job, job.advance(T0)[0])
    job.cancel_requested = "cancelled by SIGTERM"
    acts, _ = job.advance(T0 + 1)
    assert acts == [Finish(EXIT_CANCELLED, "cancelled", "cancelled by SIGTERM"), LeaveRecovery()] and job.recovery is None


def test_a_collective_error_with_nobody_dead_re_forms_after_the_grace_unless_explained():
    job = training()
    held = Held(gen=0, step=4, reason="collective error: peer closed")
    assert job.held("n0.0", "active", held) == "collective_error"
    assert job.held("s0.0", "spare", held) is None  # a spare has no collective to fail
    assert job.held("n0.0", "active", Held(gen=7, step=4, reason="collective error: x")) is None  # another generation's
    assert job.reform_if_unexplained(0) and job.attention()
    acts, _ = job.advance(T0)
    carry_out(job, acts)
    assert job.phase is Phase.RECOVERING and not job.reform_requested  # this generation is the re-forming asked for
    other = training()
    lose(other, "n1.0", T0)
    assert not other.reform_if_unexplained(0)  # explained: a failure is pending


def test_a_start_failure_of_this_generation_is_told_to_the_recovery():
    job = training()
    assert job.held("n0.0", "active", Held(gen=0, step=0, reason="start failed: no source", blame=["n1.0"])) == "start_failed"
    job.end()
    assert job.held("n0.0", "active", Held(gen=0, step=0, reason="start failed: no source")) is None


def test_a_lost_spare_is_its_own_kind_and_refills_count_missing_spare_nodes():
    job = training(spare_nodes=1)
    assert job.refills() == 0
    assert lose(job, "s0.0", T0) == SPARE_LOST and not job.pending
    job.members.exclude("s0")
    assert job.refills() == 1
    assert training(spare_nodes=1, refill=False).refills() == 0
    job.end()
    assert job.refills() == 0  # the job is over: nothing more is started


def test_a_kill_spare_fault_goes_to_one_connected_spare_once_and_dooms_it():
    job = training(spare_nodes=1, faults=[Fault(index=0, kind="kill_spare", step=5)])
    job.members.workers["s0.0"].writer = object()  # connected
    assert job.spare_fault(4) is None
    assert job.spare_fault(5) == (0, "s0.0") and job.doomed == {"s0.0"}
    assert job.spare_fault(6) is None  # sent once
    job.fault_fired(0, "kill_spare", T0)
    job.fault_fired(1, "straggler", T0 + 1)
    job.fault_fired(2, "kill_worker", T0 + 2)
    assert job.faults_done == {0, 1, 2} and job.fault_times == [T0 + 2]  # only a rank's kill is a recovery's t_fail


def test_a_job_that_may_shrink_goes_on_without_a_spare_refills_and_grows_back_once_one_is_built():
    nodes, elastic = 3, RecoveryOptions(60.0, 300.0, 3.0, 0.5, min_nodes=2, world=3)
    m = membership(nodes, 1, 0)
    job = JobMachine(m, Layout(cfg("task=mlp", "cluster.nodes=3")), 3, Options(300.0, True, 0, elastic))
    job.advance(T0, Inputs(built=True))
    assert job.refills() == 0 and not job.grow_due()
    lose(job, "n2.0", T0 + 1)
    carry_out(job, job.advance(T0 + 1)[0])
    for w in ("n0.0", "n1.0"):
        job.held(w, "active", Held(gen=0, abort_gen=1, step=7))
    acts, _ = job.advance(T0 + 1.1)
    carry_out(job, acts)
    shrunk = [a for a in acts if type(a).__name__ == "Emit" and a.event == "shrunk"]
    assert len(shrunk) == 1 and shrunk[0].fields["processes"] == 2 and kinds(acts)[-2:] == ["Assign", "ReleaseCommands"]
    for w in job.members.ranks.values():
        job.recovery.on_message(w, Joining(gen=1))
        job.recovery.on_message(w, Ready(gen=1))
    assert kinds(job.advance(T0 + 1.2)[0]) == ["Reformed", "LeaveRecovery"]
    assert sorted(job.members.ranks) == [0, 1] and job.refills() == 1  # a node to grow back with
    m.add_node("r0", "spare")
    assert not job.grow_due() and job.advance(T0 + 2)[0] == []  # not built yet
    m.workers["r0.0"].built = True
    assert not job.grow_due()  # no step heard of since: no boundary to grow at
    job.committed(9, 0.1)
    assert job.grow_due() and job.poll_moves() and job.attention()
    acts, _ = job.advance(T0 + 3)
    carry_out(job, acts)
    # a re-forming with nothing failed, planned: at step 9 + 0.5 s of 0.1 s steps, the degraded step in flight finished
    assert job.phase is Phase.RECOVERING and kinds(acts)[-1] == "Abort" and acts[-1].at_step == 14
    assert [a.fields["kind"] for a in acts if type(a).__name__ == "Emit" and a.event == "move_planned"] == ["grow"]
    for w in ("n0.0", "n1.0"):
        job.held(w, "active", Held(gen=1, abort_gen=2, step=14))
    acts, _ = job.advance(T0 + 3.1)
    grown = [a for a in acts if type(a).__name__ == "Emit" and a.event == "grown"]
    assert len(grown) == 1 and grown[0].fields["processes"] == 3 and job.members.ranks[2] == "r0.0"
    assert job.refills() == 0 and not job.grow_due()


def test_a_job_that_may_not_shrink_never_grows():
    job = training(nodes=2, spare_nodes=1)
    job.members.ranks = {0: "n0.0"}  # a rank without a process and a built spare: what grows an elastic job
    assert job.vacant == 1 and job.members.spares()[0].ready
    assert not job.grow_due()  # min_nodes is not set: the no-spare verdict stands (test above)
