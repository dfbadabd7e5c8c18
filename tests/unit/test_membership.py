"""Membership decisions without sockets: what a loss means, exclusion, survivors, a mass failure."""

from __future__ import annotations

import pytest

from ckptless_hpc.coordinator.membership import FATAL_AT_STARTUP, RECOVER, SPARE_LOST, loss_kind
from ckptless_hpc.coordinator.planner import plan_recovery
from coordlib import membership as _job

pytestmark = pytest.mark.timeout(30)


def test_what_a_loss_means():
    assert loss_kind("active", training_started=False) == FATAL_AT_STARTUP
    assert loss_kind("active", training_started=True) == RECOVER
    assert loss_kind("spare", training_started=True) == SPARE_LOST


def test_a_loss_is_idempotent_and_excluding_a_node_kills_its_idle_spares():
    m = _job(2, 2, 2)
    assert m.lose("n1.0") == "active" and m.lose("n1.0") is None
    assert m.failed() == {"n1.0"} and sorted(m.survivors()) == [0, 1, 3]
    m.lose("s0.1")
    assert m.exclude("s0") == ["s0.0"]  # the node's other, idle spare is never promoted
    assert m.exclude("s0") is None
    assert [s.worker for s in m.spares()] == ["s1.0", "s1.1"] and m.spare_nodes() == {"s1"}
    assert m.census() == (3, 2)


def test_a_mass_failure_at_10k_ranks_is_planned_and_adopted():
    m = _job(1250, 8, 130)  # 10,000 ranks, 1,040 spares
    lost_nodes = [f"n{i}" for i in range(0, 1250, 10)]  # every 10th node: 1,000 ranks
    for node in lost_nodes:
        for j in range(8):
            m.lose(f"{node}.{j}")
        m.exclude(node)
    held = {w: 42 for w in m.survivors().values()}
    plan, reason = plan_recovery(m.ranks, m.failed(), held, m.spares(), m.active_nodes, m.bad_nodes)
    assert plan is not None, reason
    assert len(plan.promoted) == 1000 and len(plan.sources) == 1000  # survivors at the target fetch nothing
    promoted_nodes = {m.workers[w].node for w in plan.promoted.values()}
    assert len(promoted_nodes) == 125  # a failed node's ranks land on whole spare nodes
    m.adopt(plan)
    m.assign(plan.ranks)
    assert len(m.survivors()) == 10_000 and not m.failed()
    assert promoted_nodes <= m.active_nodes and not (set(lost_nodes) & m.active_nodes)
    assert m.census() == (10_000, 40)


def test_too_few_spares_for_a_mass_failure_is_a_reason_not_a_crash():
    m = _job(10, 8, 1)
    for j in range(8):
        m.lose(f"n3.{j}")
        m.lose(f"n4.{j}")
    plan, reason = plan_recovery(m.ranks, m.failed(), {w: 1 for w in m.survivors().values()}, m.spares(), m.active_nodes, m.bad_nodes)
    assert plan is None and "16 rank(s)" in reason and "8 usable spare(s)" in reason


def test_typed_messages_name_the_field_and_value_they_refuse():
    from ckptless_hpc.control import messages as inbox

    held = inbox.parse({"type": "held", "gen": 0, "abort_gen": 1, "step": 5, "pid": 3, "reason": "abort", "t": 1.0})
    assert held == inbox.Held(gen=0, abort_gen=1, step=5, pid=3, reason="abort")
    assert inbox.parse({"type": "no-such-kind"}) is None
    with pytest.raises(inbox.MessageError, match=r"'ready' message: field 'gen' is missing.*HINT"):
        inbox.parse({"type": "ready"})
    with pytest.raises(inbox.MessageError, match=r"'done' message: field 'sha256' = 7 is not of type str"):
        inbox.parse({"type": "done", "gen": 1, "sha256": 7})
    with pytest.raises(inbox.MessageError, match="'gen' = True"):
        inbox.parse({"type": "joining", "gen": True})
    m = inbox.parse({"type": "metrics", "step": 3.0, "loss": float("nan"), "step_s": 0.1})
    assert m.step == 3 and isinstance(m.step, int) and m.lr is None


def test_refills_count_nodes_and_a_nodes_mates_are_its_live_ranks():
    m = _job(2, 2, 1)
    assert m.spare_nodes_missing(1) == 0 and m.spare_nodes_missing(3) == 2
    for w in ("n1.0", "n1.1"):
        m.lose(w)
    m.assign({2: "s0.0", 3: "s0.1"})  # one lost node's two ranks took one spare node's two workers
    assert m.spare_nodes_missing(1) == 1  # one node to refill, not two
    m2 = _job(2, 2, 1)
    m2.lose("n1.0")
    m2.assign({2: "s0.0"})  # a spare node half used still is a spare node
    assert m2.spare_nodes_missing(1) == 0
    assert m2.node_mates("n1.0") == ["n1.1"] and m2.node_mates("n0.1") == ["n0.0"]
    assert m2.node_mates("s0.0") == []  # its node's other worker is an idle spare (excluding the node stops it)
