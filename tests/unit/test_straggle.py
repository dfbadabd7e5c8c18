"""The injected straggler (``fault=slow``) stretches a step's compute, never its waits.

Pure: the sleep computed from the compute seconds (faults.straggle_s, faults.compute_s). Then the
worker's injector on a real thread with real waits (an event that sleeps, as a collective's wait
does) and real CPU work: what it sleeps follows the CPU the step spent, not the wall time since
the step started (which held a wait that a sleep of twice its length would make the peers wait
on in turn)."""

from __future__ import annotations

import threading
import time

import pytest

from ckptless_hpc import faults as faultlib
from ckptless_hpc.worker.injector import FaultInjector
from ckptless_hpc.worker.standing import Standing

pytestmark = pytest.mark.timeout(60)

SLOW = faultlib.Fault(index=0, kind="slow", step=5, rank=0, factor=3.0, duration=10)


def test_the_sleep_is_factor_minus_one_times_the_compute():
    assert faultlib.straggle_s(SLOW, 1.5) == pytest.approx(3.0)
    assert faultlib.straggle_s(faultlib.Fault(index=0, kind="slow", step=0, rank=0, factor=1.0), 7.0) == 0.0  # x1: no sleep
    assert faultlib.straggle_s(SLOW, -0.1) == 0.0  # a clock that stepped back never sleeps negative


def test_a_step_that_waited_long_sleeps_on_its_compute_not_its_wait():
    """The first step after a re-formation: 40 s since it started, 1.3 s of them computing, the
    rest waiting for a peer still fetching. The old sleep, (factor - 1) x 40 s = 80 s, stalled
    the peers on it in turn; now 2.6 s."""
    assert faultlib.compute_s(elapsed_s=40.0, cpu_s=1.3) == pytest.approx(1.3)
    assert faultlib.straggle_s(SLOW, faultlib.compute_s(40.0, 1.3)) == pytest.approx(2.6)


def test_the_compute_is_never_more_than_the_wall_time_since_the_step_started():
    """CPU counted since a mark before the step (work between steps) is cut at the step's own
    wall time; with no mark in the calling thread, the wall time is all there is."""
    assert faultlib.compute_s(elapsed_s=1.0, cpu_s=1.6) == pytest.approx(1.0)
    assert faultlib.compute_s(elapsed_s=1.0, cpu_s=None) == pytest.approx(1.0)
    assert faultlib.compute_s(elapsed_s=-0.5, cpu_s=0.2) == 0.0


# ---------------------------------------------------------------- the injector, on a real thread


def _burn(cpu_s: float) -> None:
    """Spend ``cpu_s`` seconds of this thread's CPU (its forward and backward)."""
    t = time.thread_time()
    while time.thread_time() - t < cpu_s:
        pass


class _Client:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg.encode())


def _injector(monkeypatch):
    slept = []
    monkeypatch.setattr("ckptless_hpc.worker.injector.time.sleep", slept.append)  # what it would sleep, not slept
    standing = Standing("n0")
    standing.join(3, 0, 2)
    inj = FaultInjector(_Client(), standing)
    inj.arm([SLOW], workers_per_node=1)
    return inj, slept


def test_a_slow_rank_that_waited_on_its_peers_sleeps_on_its_cpu_not_on_the_wait(monkeypatch):
    inj, slept = _injector(monkeypatch)
    inj.straggle(4, time.perf_counter())  # a healthy step: no sleep, the mark set
    assert slept == []
    t0 = time.perf_counter()
    threading.Event().wait(0.5)  # the step waits on a peer (a collective's wait sleeps in an event)
    c0 = time.thread_time()
    _burn(0.05)  # then computes its forward and backward
    inj.straggle(5, t0)
    cpu = time.thread_time() - c0
    elapsed = time.perf_counter() - t0
    (sleep_s,) = slept
    assert sleep_s >= 2 * 0.05, (sleep_s, cpu)  # the compute is stretched x3
    assert sleep_s < 2 * (cpu + 0.02), (sleep_s, cpu)  # by its CPU (plus the few calls between the mark and c0) ...
    assert sleep_s < elapsed, (sleep_s, elapsed)  # ... never by the wall time, waits included (the old sleep: 2 x elapsed)
    assert [m["type"] for m in inj.client.sent] == ["fault"]  # reported once, as it starts


def test_the_work_between_steps_is_not_the_next_steps_compute(monkeypatch):
    """The optimizer update (and an evaluation, an abort taken) moves the mark through
    ``fire_due``: the next step's compute counts from there, even when that step starts with a
    wait long enough for the wall-time bound not to cut the update off."""
    inj, slept = _injector(monkeypatch)
    inj.straggle(5, time.perf_counter())
    _burn(0.2)  # step 5's optimizer update ...
    inj.fire_due("update", 5)  # ... then the mark
    t0 = time.perf_counter()
    threading.Event().wait(0.5)  # step 6 waits (ZeRO's parameter sync) ...
    c0 = time.thread_time()
    _burn(0.05)  # ... and computes
    inj.straggle(6, t0)
    cpu = time.thread_time() - c0
    assert 2 * 0.05 <= slept[-1] < 2 * (cpu + 0.02) < 2 * 0.2, (slept, cpu)


def test_faults_fired_from_other_threads_leave_the_training_threads_mark(monkeypatch):
    """A fetch thread asks for its "receive" faults while the step computes: the mark stays the
    training thread's, so the step's compute is still counted whole, and its wait still not."""
    inj, slept = _injector(monkeypatch)
    inj.straggle(5, time.perf_counter())
    t0 = time.perf_counter()
    threading.Event().wait(0.5)
    c0 = time.thread_time()
    _burn(0.1)
    other = threading.Thread(target=inj.fire_due, args=("receive", 6))
    other.start()
    other.join()
    _burn(0.1)
    inj.straggle(6, t0)
    cpu = time.thread_time() - c0
    assert 2 * 0.2 <= slept[-1] < 2 * (cpu + 0.02), (slept, cpu)
