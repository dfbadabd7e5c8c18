"""The heartbeat rule cannot fire because the coordinator itself stalled (injected clock, no sockets)."""

from __future__ import annotations

import pytest

from ckptless_hpc.coordinator.detector import StallMeter, silent_workers
from ckptless_hpc.coordinator.shell import Coordinator, WorkerRec
from coordlib import FakeWriter, NoLauncher, cfg, training

pytestmark = pytest.mark.timeout(30)
TIMEOUT = 3.0


def _ticks(meter: StallMeter, until: float, every: float = 0.5) -> None:
    t = meter.last_tick
    while t + every <= until + 1e-9:
        t += every
        meter.tick(t)


def test_ticks_on_time_count_no_stall_and_a_late_one_counts_its_lateness():
    m = StallMeter(0.5, last_tick=0.0)
    _ticks(m, 10.0)
    assert m.stalled_s == pytest.approx(0.0)
    assert m.tick(10.9) == 0.0  # up to one interval late: jitter, not a stall
    assert m.tick(16.4) == pytest.approx(4.5) and m.stalled_s == pytest.approx(4.5) and m.worst_s == pytest.approx(4.5)


def test_a_stall_longer_than_the_timeout_declares_nobody():
    m = StallMeter(0.5, last_tick=10.0)
    seen, at = {"a": 10.0, "b": 9.9}, {"a": 0.0, "b": 0.0}
    m.tick(16.0)  # the loop was stuck from 10.0 to 16.0: heartbeats sat unread
    assert silent_workers(16.0, seen, seen, TIMEOUT, m.stalled_s, at) == []
    assert silent_workers(16.0, seen, seen, TIMEOUT) != []  # the old rule: two false failures


def test_a_real_hang_is_declared_after_the_timeout_of_awake_time():
    m = StallMeter(0.5, last_tick=10.0)
    seen, at = {"hung": 10.0, "ok": 10.0}, {"hung": 0.0, "ok": 0.0}
    m.tick(14.5)  # 3.5 s of stall right after its last heartbeat
    for now in (15.0, 15.5, 16.0, 16.5):
        m.tick(now)
        seen["ok"], at["ok"] = now, m.stalled_s
        out = silent_workers(now, seen, seen, TIMEOUT, m.stalled_s, at)
        assert out == []  # at most 3.0 s of awake silence so far
    m.tick(17.0)
    out = silent_workers(17.0, seen, seen, TIMEOUT, m.stalled_s, at)
    assert [w for w, _ in out] == ["hung"] and "stalled 3.5s" in out[0][1] and "timeout 3.0s" in out[0][1]


def test_unread_bytes_mean_not_silent():
    seen = {"a": 0.0}
    assert silent_workers(10.0, seen, seen, TIMEOUT, pending=lambda w: True) == []
    assert [w for w, _ in silent_workers(10.0, seen, seen, TIMEOUT, pending=lambda w: False)] == ["a"]


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_coordinator_judges_silence_net_of_its_own_stall(tmp_path):
    clock = Clock(100.0)
    launcher = NoLauncher()
    c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2"), str(tmp_path), launcher, "s" * 64, "job-test", clock=clock)
    training(c, 0, 100.0)
    for i in range(2):
        c.workers[f"n{i}.0"] = WorkerRec(f"n{i}.0", f"n{i}", 0, "active", writer=FakeWriter(), rank=i, built=True, last_seen=100.0)
    c.ranks = {0: "n0.0", 1: "n1.0"}
    c.health.stalls.last_tick = 100.0
    c.health.stalls.tick(108.0)  # a 7.5 s stall of the loop (7.0 s beyond the tolerance), e.g. a long garbage collection
    c._judge_silence(108.0)
    assert launcher.killed == [] and not c.job.pending
    c.workers["n0.0"].last_seen, c.workers["n0.0"].seen_stall = 108.0, c.health.stalls.stalled_s  # n0 speaks, n1 stays silent
    for t in (108.5, 109.0, 109.5, 110.0, 110.5, 111.0):
        c.health.stalls.tick(t)
    c._judge_silence(111.0)
    assert launcher.killed == ["n1.0"] and list(c.job.pending) == ["n1.0"]
    c.events.close()
