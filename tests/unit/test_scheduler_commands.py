"""Scheduler commands run off the coordinator's loop, after the promotion (issue 14).

The queue is a real thread running real callables; the coordinator's recovery is driven by its
own messages (no sockets). The real-Slurm proof is tests/slurm/test_slurm_training.py's crashed
node, whose scancel is measured there.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, List

import pytest

from ckptless_hpc.control import wire
from ckptless_hpc.coordinator.shell import Coordinator, WorkerRec
from ckptless_hpc.launch.background import CommandQueue
from coordlib import NoLauncher, cfg, recover, training

pytestmark = pytest.mark.timeout(30)


def _recorder(log: List[str], name: str, gate: threading.Event = None, started: threading.Event = None):
    def run() -> None:
        if started is not None:
            started.set()
        if gate is not None:
            gate.wait(10)
        log.append(name)

    return run


def test_held_commands_wait_for_the_release_then_run_in_order():
    ran: List[str] = []
    started = threading.Event()
    q = CommandQueue()
    q.hold()
    q.submit("cancel_step", _recorder(ran, "cancel", started=started), node="n2", slurm_step=3)
    q.submit("drain_node", _recorder(ran, "drain"), node="n2")
    assert not started.wait(0.2)  # held: the thread is up, the command waits
    assert q.pending() == 2 and ran == []
    q.release()
    assert q.drain(10)
    assert ran == ["cancel", "drain"]
    assert [o["action"] for o in q.outcomes] == ["cancel_step", "drain_node"]
    first = q.outcomes[0]
    assert first["ok"] and first["node"] == "n2" and first["slurm_step"] == 3
    assert first["waited_s"] >= 0.2 - 0.05  # it waited for the release, not for a thread to start


def test_a_failed_command_is_reported_and_the_next_one_still_runs():
    ran: List[str] = []
    reports: List[dict] = []

    def fails() -> None:
        raise RuntimeError("`scancel 7.3` exited 1: Invalid job id")

    q = CommandQueue(report=reports.append)
    q.submit("cancel_step", fails, job="7", node="n3", slurm_step=3)
    q.submit("drain_node", _recorder(ran, "drain"), job="7", node="n3")
    assert q.drain(10)
    assert ran == ["drain"]
    assert reports[0]["ok"] is False and "Invalid job id" in reports[0]["error"] and reports[0]["job"] == "7"
    assert reports[1]["ok"] is True and reports[1]["error"] is None
    q.submit("late", _recorder(ran, "late"))  # closed by drain: refused, not run
    assert ran == ["drain"]


def test_submitting_never_waits_for_a_slow_command():
    gate = threading.Event()
    ran: List[str] = []
    q = CommandQueue()
    q.submit("slow", _recorder(ran, "slow", gate))
    q.submit("next", _recorder(ran, "next"))  # returns while "slow" still runs
    assert ran == [] and q.pending() == 2
    gate.set()
    assert q.drain(10) and ran == ["slow", "next"]


class OrderLauncher(NoLauncher):
    """Writes every launcher call and every frame the coordinator sends into one list."""

    def __init__(self, order: List[Any]) -> None:
        super().__init__()
        self.order = order

    def hold_commands(self) -> None:
        self.order.append(("hold",))

    def release_commands(self) -> None:
        self.order.append(("release",))

    def kill_worker(self, worker: str) -> None:
        self.order.append(("kill", worker))

    def exclude_node(self, node: str, why: str) -> None:
        self.order.append(("exclude", node))


class OrderWriter:
    def __init__(self, wid: str, order: List[Any]) -> None:
        self.wid, self.order = wid, order

    def is_closing(self) -> bool:
        return False

    def write(self, frame: bytes) -> None:
        self.order.append(("send", self.wid, wire.decode(frame[4:])["type"]))

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str) -> None:
        return None


def test_the_recovery_sends_the_promotion_before_any_scheduler_command(tmp_path):
    order: List[Any] = []
    c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2", "cluster.refill_spares=false"), str(tmp_path), OrderLauncher(order), "s" * 64, "job-test")
    for i, role in enumerate(("active", "active", "spare")):
        wid = f"n{i}.0"
        c.workers[wid] = WorkerRec(wid, f"n{i}", 0, role, writer=OrderWriter(wid, order), rank=i if role == "active" else None, built=True, host="h", state_port=1)
    c.ranks = {0: "n0.0", 1: "n1.0"}
    c.members.active_nodes = {"n0", "n1"}
    training(c, 0, 1.0)

    async def drive() -> None:
        c._lost(c.workers["n1.0"], "control connection closed (test)")
        task = asyncio.ensure_future(recover(c))
        while ("send", "n0.0", "abort") not in order:
            await asyncio.sleep(0)
        c.reader.dispatch(c.workers["n0.0"], {"type": "held", "gen": 0, "abort_gen": 1, "step": 7, "pid": 1})
        c._notify()
        while ("send", "n2.0", "assign") not in order:
            await asyncio.sleep(0)
        for wid in ("n0.0", "n2.0"):
            c.reader.dispatch(c.workers[wid], {"type": "ready", "gen": 1, "pid": 1})
        c._notify()
        assert await asyncio.wait_for(task, 10) is None

    asyncio.run(drive())
    c.events.close()
    scheduler = [i for i, o in enumerate(order) if o[0] in ("kill", "exclude")]
    promoted = order.index(("send", "n2.0", "assign"))
    assert order.index(("hold",)) < min(scheduler)  # held before the first command was queued
    assert order.index(("release",)) > promoted  # released only once the spare has its rank
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events.index("spare_promoted") < events.index("reformed")


def test_flush_waits_for_every_queued_command_and_keeps_the_queue_open():
    ran: List[str] = []
    q = CommandQueue()
    q.hold()
    q.submit("drain_node", _recorder(ran, "drain"), node="n2")
    assert q.flush(10) and ran == ["drain"] and not q.held  # a requeue may follow now
    q.submit("cancel_step", _recorder(ran, "cancel"))
    assert q.drain(10) and ran == ["drain", "cancel"]
