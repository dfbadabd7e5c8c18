"""The worker's collaborators without processes (worker/agent.py holds them): the waiter the
coordinator cuts short, the fault injector's report and ack, the standing the log lines follow,
and the agent's dispatch on the coordinator's messages."""

from __future__ import annotations

import logging
import threading

import pytest

from ckptless_hpc import faults as faultlib
from ckptless_hpc.worker.agent import Address, Agent
from ckptless_hpc.worker.injector import FaultInjector
from ckptless_hpc.worker.interrupt import Aborted, CollectiveError, Waiter
from ckptless_hpc.worker.standing import Standing

pytestmark = pytest.mark.timeout(60)


class _Client:
    def __init__(self, inbox=()):
        self.sent, self.inbox = [], list(inbox)

    def send(self, msg):  # as ControlClient.send: a message class is sent encoded
        self.sent.append(msg if isinstance(msg, dict) else msg.encode())

    def next_message(self, timeout_s=None):
        if not self.inbox:
            raise StopIteration  # ends serve_forever in the test
        return self.inbox.pop(0)


def test_a_wait_returns_its_value_is_cut_by_a_newer_abort_and_bounded():
    w = Waiter()
    assert w.run(lambda: 7, gen=2, timeout_s=5, what="form-group") == 7
    release = threading.Event()
    threading.Timer(0.05, lambda: w.abort(3)).start()
    with pytest.raises(Aborted, match="fetch-state"):
        w.run(release.wait, gen=2, timeout_s=30, what="fetch-state")
    assert w.cut(2) and not w.cut(3)  # only work of an older generation is cut
    with pytest.raises(CollectiveError, match="timed out after 0.1s"):
        w.run(release.wait, gen=3, timeout_s=0.1, what="allreduce")
    release.set()
    with pytest.raises(ValueError, match="boom"):  # an error in the thread is the caller's
        w.run(lambda: (_ for _ in ()).throw(ValueError("boom")), gen=3, timeout_s=5, what="x")
    w.stop()
    assert w.cut(3) and w.wait_until(lambda: False, 3, 5) == "abort"


def test_a_fault_is_reported_then_fired_once_the_coordinator_recorded_it(monkeypatch):
    fired = []
    monkeypatch.setattr(faultlib, "fire", lambda fault, *slurm: fired.append(fault))  # the Slurm environment and cancel_step ride along
    standing, client = Standing("n0"), _Client()
    standing.join(4, 1, 2)
    inj = FaultInjector(client, standing)
    fault = faultlib.Fault(index=0, kind="kill_worker", step=3, rank=1)
    inj.arm([fault], workers_per_node=1)
    assert inj.due("step", 2) is None and inj.due("step", 3) == fault
    threading.Timer(0.05, lambda: inj.ack(0)).start()
    inj.fire_due("step", 3)
    assert fired == [fault]
    (msg,) = client.sent
    assert list(msg) == ["type", "index", "kind", "at", "gen", "rank", "step", "pid"]  # the wire's key order
    assert (msg["type"], msg["index"], msg["gen"], msg["rank"], msg["step"]) == ("fault", 0, 4, 1, 3)
    inj.done.add(0)
    assert inj.due("step", 3) is None  # fired (here or by anyone before): never again


def test_a_straggler_is_reported_once_and_slows_the_step(monkeypatch):
    slept = []
    monkeypatch.setattr("ckptless_hpc.worker.injector.time.sleep", slept.append)
    standing, client = Standing("n0"), _Client()
    standing.join(1, 0, 2)
    inj = FaultInjector(client, standing)
    inj.arm([faultlib.Fault(index=2, kind="slow", step=1, rank=0, factor=3.0, duration=5)], 1)
    inj.straggle(1, t0=0.0)
    inj.straggle(2, t0=0.0)
    assert [m["at"] for m in client.sent] == ["step"] and len(slept) == 2 and all(s > 0 for s in slept)


def test_the_log_lines_follow_the_standing():
    s = Standing("n3")
    assert s.ctx == {"job": "-", "gen": "-", "rank": "spare", "node": "n3", "step": "-"}
    s.join(5, 2, 4)
    s.at(9)
    assert (s.ctx["gen"], s.ctx["rank"], s.ctx["step"]) == (5, 2, 9)
    s.lost()
    assert s.step is None and s.ctx["step"] == "-"
    assert list(s.heartbeat()) == ["gen", "step", "training", "compute_s"]


def _agent(inbox=()):
    a = Agent(Address("n0", 1, "127.0.0.1:1", "127.0.0.1", "s" * 32))
    a.client = _Client(inbox)
    a.faults = FaultInjector(a.client, a.standing)
    return a


def test_the_reader_thread_takes_aborts_stops_and_acks_on_arrival():
    a = _agent()
    a._on_message({"type": "abort", "gen": 4})
    a._on_message({"type": "abort", "gen": 2})  # an older one never lowers it
    assert a.waiter.abort_gen == 4 and a.waiter.wake.is_set() and not a.waiter.stopping
    a._on_message({"type": "fault_ack", "index": 3})
    assert 3 in a.faults._acks
    a._on_message({"type": "stop"})
    assert a.waiter.stopping and a.waiter.cut(10)


def test_the_main_thread_dispatches_on_the_message_type(caplog):
    class _Peers:
        def held_step(self):
            return 6

    a = _agent([{"type": "abort", "gen": 3}, {"type": "copy_at", "step": 8}, {"type": "nonsense"}])
    a.peers, a.standing.gen = _Peers(), 2
    with caplog.at_level(logging.WARNING, logger="ckptless_hpc.worker"), pytest.raises(StopIteration):
        a.serve_forever()
    (held,) = a.client.sent  # the abort is answered with what it holds; copy_at was taken on arrival
    assert list(held) == ["type", "gen", "abort_gen", "step", "pid", "reason"]
    assert (held["gen"], held["abort_gen"], held["step"], held["reason"]) == (2, 3, 6, "abort")
    assert "ignoring unknown message 'nonsense'" in caplog.text


class _Group:
    """Stands for a generation's gloo group: which thread dropped its last reference."""

    def __init__(self, released):
        self.released = released

    def __del__(self):
        self.released.append(threading.current_thread().name)


@pytest.mark.parametrize("cut", ["collective", "abort"])
def test_a_failed_steps_groups_are_released_in_the_release_thread_not_the_main_one(cut):
    """pp x tp hang: a step cut short (a failed collective, or an abort) raised through frames
    that hold the generation's groups; the release thread dropped its references first, so the
    main thread dropped the last one with the exception, and destroying a gloo group with an op in
    flight waits up to cluster.collective_timeout_s: the rank's Held was never sent. The frames
    are cleared before the release, which then drops the last reference."""
    from types import SimpleNamespace

    from ckptless_hpc.train.grouped import StepFailed
    from ckptless_hpc.worker.steps import Steps

    released = []

    class Engine:
        comm = None

        def step(self, step, after_backward, wait):
            comm = self.comm  # noqa: F841 - the schedule's and the strategy's frames hold the groups
            if cut == "abort":
                raise Aborted("allreduce")
            try:
                raise RuntimeError("Connection closed by peer")
            except RuntimeError as err:
                raise StepFailed(f"step {step}: {err}") from None

    engine = Engine()
    engine.comm = _Group(released)

    def abandon():  # as Groups.abandon -> fsdp.release_in_background: the last references go in a thread
        objs = [engine.comm]
        engine.comm = None
        t = threading.Thread(target=objs.clear, name="release-generation")
        t.start()
        t.join()

    cfg = SimpleNamespace(train=SimpleNamespace(steps=5, eval_every=0), cluster=SimpleNamespace(collective_timeout_s=5))
    standing = SimpleNamespace(step=2, training=False)
    steps = Steps(cfg, engine, _Client(), standing, Waiter(), None, SimpleNamespace(behind=None, drop_behind=lambda: None), None, None, SimpleNamespace(abandon=abandon), None)
    failed = steps.run(gen=0)
    assert (failed is None) == (cut == "abort")
    assert released == ["release-generation"]


def test_a_pipelines_schedule_and_communicators_backends_go_in_the_release_thread():
    """pp x tp hang, seen with SIGUSR1 on the rank that never held: its main thread stuck in
    PPStrategy.let_go at ``self.schedule = None`` (the schedule's stages held the failed step's
    groups and ops). The schedules and each communicator's backend go to the release thread; the
    callers' frames keep only the communicator's shell."""
    from types import SimpleNamespace

    from ckptless_hpc.train.comm import Communicator
    from ckptless_hpc.train.pp import PPStrategy

    released = []
    pp = object.__new__(PPStrategy)
    pp.schedule, pp.eval_schedule, pp.mesh, pp.binding = _Group(released), None, None, None
    pp.e = SimpleNamespace(comm=None)
    comm = object.__new__(Communicator)
    comm.pg, comm.hsdp = _Group(released), None
    before = {t.ident for t in threading.enumerate()}
    assert pp.let_go(comm) is True
    for t in threading.enumerate():
        if t.ident not in before and t.name == "release-generation":
            t.join(10)
    assert pp.schedule is None and comm.pg is None and released == ["release-generation"] * 2
