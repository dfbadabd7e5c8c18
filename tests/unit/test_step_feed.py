"""Rank 0's per-step metrics as decisions (coordinator/step_feed.py): the step log, the end of a
recovery and the progress figures from messages and times; no sockets, no sleeps. Then the
coordinator's thin shell: the events a resumed step writes."""

from __future__ import annotations

import json

import pytest

from ckptless_hpc.control.messages import Metrics
from ckptless_hpc.coordinator.shell import Coordinator, WorkerRec
from ckptless_hpc.coordinator.step_feed import HeadCount, StepFeed, resumed
from ckptless_hpc.metrics import Recovery, StepLog
from coordlib import FakeWriter, NoLauncher, cfg, training

pytestmark = pytest.mark.timeout(60)

T0 = 1000.0


def _recovery(target_step=None) -> Recovery:
    return Recovery(gen=1, failed_ranks=[1], failed_nodes=["n1"], failed_workers=["n1.0"], reasons=["test"], t_fail=T0, t_detect=T0 + 0.5, target_step=target_step, t_ready=T0 + 2.0)


def _feed(census=lambda: (4, 1)) -> StepFeed:
    return StepFeed(StepLog(), total_steps=100, world=4, census=census)


def _m(step: int, **kw) -> Metrics:
    return Metrics(step=step, loss=kw.pop("loss", 1.0), step_s=kw.pop("step_s", 0.1), **kw)


def test_a_recovery_ends_at_the_first_step_past_its_target():
    r = _recovery(target_step=7)
    assert not resumed(None, 100)
    assert not resumed(_recovery(target_step=None), 100)  # not re-formed yet: no target step
    assert not resumed(r, 6) and not resumed(r, 7)  # the step it re-formed at is not a new one
    assert resumed(r, 8)


def test_the_feed_reports_the_resumption_once_with_the_spares_to_refill():
    f = _feed()
    assert f.on_step(_m(5), T0) is None  # no recovery: nothing ends
    r = _recovery(target_step=7)
    f.reformed(r, refills=1)
    assert f.on_step(_m(7), T0 + 3.0) is None
    back = f.on_step(_m(8), T0 + 3.5)
    assert back is not None and back.recovery is r and back.refills == 1
    assert r.t_resumed == T0 + 3.5 and r.report()["downtime_s"] == pytest.approx(3.5)
    assert f.on_step(_m(9), T0 + 4.0) is None and f.resuming is None and f.refills_due == 0
    assert f.steps.last_step == 9


def test_a_recovery_during_a_recovery_refills_for_both_and_ends_at_the_newer_target():
    f = _feed()
    first, second = _recovery(target_step=7), _recovery(target_step=5)
    f.reformed(first, refills=1)
    f.reformed(second, refills=2)  # failed again before the first step past 7 was committed
    back = f.on_step(_m(6), T0 + 5.0)
    assert back is not None and back.recovery is second and back.refills == 3
    assert first.t_resumed is None


def test_the_snapshot_figures_come_from_the_step_log_and_the_time():
    f = _feed()
    for s in range(1, 11):
        f.on_step(_m(s, step_s=0.5), T0 + s)
    snap = f.snapshot(_m(10, loss=0.25, samples=8), now=T0 + 10.0, t_train=T0, recoveries=2, gen=3)
    assert (snap.step, snap.total, snap.loss, snap.world, snap.alive, snap.spares, snap.recoveries, snap.gen) == (10, 100, 0.25, 4, 4, 1, 2, 3)
    assert snap.steps_per_s == pytest.approx(2.0) and snap.samples_per_s == pytest.approx(16.0)
    assert snap.goodput == pytest.approx(5.0 / 10.0)  # 10 steps of 0.5 s in 10 s of training
    early = f.snapshot(_m(10), now=T0 + 10.0, t_train=None, recoveries=0, gen=0)
    assert early.samples_per_s is None and early.goodput == 0.0  # no samples reported; training not started: no wall time yet


def test_the_head_count_is_taken_at_most_every_half_second():
    calls = []

    def census():
        calls.append(1)
        return len(calls), 0

    h = HeadCount(census)
    assert h(T0) == (1, 0)
    assert h(T0 + 0.4) == (1, 0) and len(calls) == 1  # per step: not counted again
    assert h(T0 + 0.5) == (2, 0)
    assert h(T0 - 10.0) == (3, 0)  # the clock went back: counted anew


def test_a_step_past_the_recovery_target_writes_resumed_after_its_step_event(tmp_path):
    clock = [T0]
    c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2", "cluster.refill_spares=false"), str(tmp_path), NoLauncher(), "s" * 64, "job-test", clock=lambda: clock[0])
    rec = c.workers["n0.0"] = WorkerRec("n0.0", "n0", 0, "active", writer=FakeWriter(), rank=0)
    c.ranks = {0: "n0.0"}
    training(c, 1, T0)
    r = _recovery(target_step=7)
    c.record.recoveries.append(r)
    c.telemetry.feed.reformed(r, refills=0)
    for step, t in ((7, T0 + 3.0), (8, T0 + 3.5), (9, T0 + 4.0)):
        clock[0] = t
        c.reader.dispatch(rec, {"type": "metrics", "step": step, "loss": 1.0, "step_s": 0.1, "gen": 1})
    c.events.close()
    ev = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in ev] == [("step", 7), ("step", 8), ("resumed", 8), ("step", 9)]
    back = ev[2]
    assert back["downtime_s"] == pytest.approx(3.5) and back["time"] == T0 + 3.5 and back["rank"] == 0 and back["gen"] == 1
    assert r.t_resumed == T0 + 3.5 and c.steps.last_step == 9
