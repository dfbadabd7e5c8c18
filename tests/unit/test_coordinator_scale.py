"""The coordinator at 10k-100k ranks, without sockets: bounded messages, linear work."""

from __future__ import annotations

import json

import pytest

from ckptless_hpc.control import wire
from ckptless_hpc.control import messages
from ckptless_hpc.coordinator.planner import MAX_SOURCES, Spare, plan_recovery
from ckptless_hpc.coordinator.shell import Coordinator, WorkerRec
from coordlib import FakeWriter, NoLauncher, cfg

pytestmark = pytest.mark.timeout(60)

WORLD = 100_000


def _ranks(world: int, wpn: int = 1):
    return {r: f"n{r // wpn}.{r % wpn}" for r in range(world)}


def test_a_mass_failure_names_a_few_sources_per_fetcher_spread_over_holders():
    ranks = _ranks(WORLD, 4)
    failed = {w for r, w in ranks.items() if r % 40 < 4}  # every 10th node of 4 ranks
    held = {w: (11 if r % 2 else 10) for r, w in ranks.items() if w not in failed}  # half are a step behind
    spares = [Spare(f"s{i // 4}.{i % 4}", f"s{i // 4}", True) for i in range(len(failed))]
    plan, reason = plan_recovery(ranks, failed, held, spares, {f"n{i}" for i in range(WORLD // 4)}, set())
    assert plan is not None, reason
    assert plan.target_step == 11 and len(plan.promoted) == len(failed)
    assert all(1 <= len(s) <= MAX_SOURCES for s in plan.sources.values())
    first = {}
    for s in plan.sources.values():
        first[s[0]] = first.get(s[0], 0) + 1
    assert max(first.values()) <= 2  # no holder serves many more than its share


def test_an_assign_stays_far_below_the_frame_limit_at_100k_ranks():
    ranks = _ranks(WORLD)
    held = {w: 5 for w in ranks.values() if w != "n7.0"}
    plan, _ = plan_recovery(ranks, {"n7.0"}, held, [Spare("s.0", "s", True)], set(), set())
    ends = {w: ("10.0.0.1", 40000) for w in ranks.values()}
    msg = messages.assign(3, 7, WORLD, 5, plan.sources["s.0"], ends, list(range(50)))
    assert len(wire.encode(msg)) < 4096 < wire.MAX_FRAME
    assert [s["worker"] for s in msg["sources"]] == plan.sources["s.0"]


def _coordinator(tmp_path, **kw):
    c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2"), str(tmp_path), NoLauncher(), "s" * 64, "job-test", **kw)
    return c


def test_an_oversized_message_is_refused_by_name_not_raised(tmp_path, caplog):
    c = _coordinator(tmp_path)
    rec = c.workers["n0.0"] = WorkerRec("n0.0", "n0", 0, "active", writer=FakeWriter(), rank=0)
    c.control.send(rec, {"type": "assign", "junk": "x" * (wire.MAX_FRAME + 1)})  # must not raise
    assert rec.writer.frames == []
    assert "assign" in caplog.text and "n0.0" in caplog.text and "HINT" in caplog.text
    c.events.close()
    ev = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev[-1]["event"] == "send_refused" and ev[-1]["rank"] == 0 and ev[-1]["node"] == "n0"


def test_the_step_log_stays_bounded_and_counts_a_redone_step_once():
    from ckptless_hpc.metrics import StepLog

    log = StepLog(window=64)
    for step in range(1, 200_001):
        log.add(step, loss=1.0 / step, step_s=0.01)
    log.add(199_999, loss=0.5, step_s=0.02)  # redone after a recovery: replaces its entry
    log.add(200_000, loss=0.25, step_s=0.01)
    assert len(log) <= 64
    assert log.last_step == 200_000 and log.last_loss == 0.25
    assert log.productive_s == pytest.approx(200_000 * 0.01 + 0.01, rel=1e-9)
    assert log.steps_per_s(200_000) == pytest.approx(10 / (9 * 0.01 + 0.02))


def test_the_step_log_of_a_coordinator_is_the_bounded_one(tmp_path):
    c = _coordinator(tmp_path)
    rec = c.workers["n0.0"] = WorkerRec("n0.0", "n0", 0, "active", writer=FakeWriter(), rank=0)
    c.ranks = {0: "n0.0"}
    for step in range(1, 2001):
        c.reader.dispatch(rec, {"type": "metrics", "step": step, "loss": 1.0, "step_s": 0.01, "gen": 0})
    assert len(c.steps) <= c.steps.window and c.steps.last_step == 2000
    assert c.telemetry.progress is not None and c.telemetry.feed.head_count.last[1] == 1
    c.events.close()


def test_start_up_groups_ranks_by_node_in_one_pass():
    from ckptless_hpc.coordinator.planner import by_node, initial_ranks

    workers = [(f"n{i // 2}.{i % 2}", f"n{i // 2}") for i in reversed(range(20_000))]
    groups = by_node(workers)
    assert [n for n, _ in groups[:3]] == ["n0", "n1", "n2"] and groups[-1][0] == "n9999"
    ranks = initial_ranks(groups)
    assert ranks[0] == "n0.1" and ranks[3] == "n1.0" and len(ranks) == 20_000


def test_waiting_for_every_worker_costs_linear_checks_in_all():
    from ckptless_hpc.coordinator.tally import Arrivals

    keys = [f"w{i}" for i in range(10_000)]
    got, calls = set(), [0]

    def has(k):
        calls[0] += 1
        return k in got

    done = Arrivals(keys, has)
    for k in reversed(keys):  # the worst order: the first key arrives last
        got.add(k)
        assert done() is (k == keys[0])
    assert calls[0] <= 2 * len(keys) + 10
    assert Arrivals(["a", "b"], {"b"}.__contains__).missing() == ["a"]


def test_the_heartbeat_delay_histogram_is_bounded_and_gives_percentiles():
    from ckptless_hpc.metrics import DelayHistogram

    h = DelayHistogram()
    assert h.percentile_ms(0.99) is None
    for i in range(1000):
        h.add(0.0004 if i < 990 else 0.0305)
    h.add(99.0)  # beyond the last bucket
    h.add(-0.01)  # a clock behind ours
    assert len(h.counts) == DelayHistogram.BUCKETS + 1
    assert h.percentile_ms(0.5) == 1.0 and h.percentile_ms(0.99) == 31.0
    assert h.report()["count"] == 1002 and h.report()["max_ms"] == 99000.0
