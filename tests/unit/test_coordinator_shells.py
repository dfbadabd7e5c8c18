"""The small pieces the coordinator's server is a shell around, tested without sockets or
processes: waiting on its state (wakeup.py), reporting stragglers once (detector.py), echoing
the console rank's log (progress.py), describing a scheduler command's outcome, refilling the
spare pool by nodes, and a node's ranks lost together where its step is one."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ckptless_hpc.coordinator.detector import StragglerWatch, StragglerWindow
from ckptless_hpc.coordinator.shell import Coordinator
from ckptless_hpc.coordinator.wakeup import Wakeup
from ckptless_hpc.coordinator.scheduler_log import describe, event_fields
from ckptless_hpc.progress import ConsoleEcho, Progress
from coordlib import NoLauncher, cfg, membership, training

pytestmark = pytest.mark.timeout(60)

RANKS = {0: "a.0", 1: "b.0", 2: "c.0"}


def test_a_straggler_is_reported_when_it_becomes_one_and_when_it_stops():
    w = StragglerWindow(size=4, min_samples=2)
    watch = StragglerWatch(w, factor=3.0)
    step = 0

    def feed(slow_s: float) -> None:
        nonlocal step
        for r, wid in RANKS.items():
            w.add(wid, step, slow_s if r == 1 else 0.01)
        step += 1

    for _ in range(2):
        feed(0.10)
    new, cleared = watch.judge(RANKS)
    assert list(new) == [1] and new[1] == pytest.approx(10.0) and cleared == []
    feed(0.10)
    assert watch.judge(RANKS) == ({}, [])  # still slow: not reported again
    assert set(watch.slow) == {1}
    for _ in range(4):
        feed(0.01)
    assert watch.judge(RANKS) == ({}, [1])
    assert watch.judge(RANKS) == ({}, []) and watch.slow == {}


def test_a_straggler_leaving_the_active_ranks_is_cleared():
    w = StragglerWindow(size=4, min_samples=2)
    watch = StragglerWatch(w, factor=3.0)
    for step in range(2):
        for r, wid in RANKS.items():
            w.add(wid, step, 0.10 if r == 2 else 0.01)
    assert list(watch.judge(RANKS)[0]) == [2]
    assert watch.judge({0: "a.0", 1: "b.0"}) == ({}, [2])  # rank 2 failed: judged among the others only


def test_a_notify_wakes_each_waiter_once_per_loop_iteration():
    async def go() -> None:
        wake, state = Wakeup(), {"n": 0}
        checks = []

        def cond() -> bool:
            checks.append(state["n"])
            return state["n"] >= 3

        waiter = asyncio.ensure_future(wake.until(cond, 10.0))
        await asyncio.sleep(0)
        for _ in range(3):  # three messages read in one iteration: one wake-up
            state["n"] += 1
            wake.notify()
        assert await waiter is True
        assert checks == [0, 3]

    asyncio.run(go())


def test_until_gives_up_at_its_timeout_and_notify_without_a_loop_is_harmless():
    Wakeup().notify()  # a unit test driving decisions directly: no loop, nothing waits

    async def go() -> bool:
        return await Wakeup().until(lambda: False, 0.01)

    assert asyncio.run(go()) is False


def test_the_console_echoes_the_current_holder_of_the_rank(tmp_path, capsys):
    a, b = tmp_path / "n0.0.log", tmp_path / "s0.0.log"
    holder = {"path": None}
    echo = ConsoleEcho(Progress(total=3, log_every=1, tty=False), lambda: holder["path"])
    echo.once()
    a.write_text("rank 0 step 1\n")
    holder["path"] = str(a)
    echo.once()
    assert capsys.readouterr().out == "rank 0 step 1\n"
    b.write_text("spare now rank 0\n")
    holder["path"] = str(b)
    echo.once()
    assert capsys.readouterr().out == "spare now rank 0\n"

    async def follow() -> None:
        stop = {"now": False}
        task = asyncio.ensure_future(echo.follow(lambda: stop["now"], every_s=0.01))
        with b.open("a") as f:
            f.write("rank 0 step 2\n")
        while "step 2" not in capsys.readouterr().out:
            await asyncio.sleep(0.01)
        stop["now"] = True
        await asyncio.wait_for(task, 5.0)

    asyncio.run(follow())


def test_a_scheduler_command_outcome_is_described_with_gen_rank_and_step():
    ok = {"action": "cancel_step", "job": "7", "worker": "n1.0", "node": "n1", "slurm_step": "7.3", "ok": True, "error": None, "seconds": 1.234, "waited_s": 0.5}
    assert describe(ok, 2, 1, 40) == (logging.INFO, "cancel_step (node n1, Slurm step 7.3, gen 2, rank 1, at step 40) took 1.23s, queued 0.50s before")
    failed = dict(ok, ok=False, error="slurmctld timed out")
    assert describe(failed, 2, None, None) == (logging.WARNING, "cancel_step (node n1, Slurm step 7.3, gen 2, rank None, at step None) failed after 1.23s: slurmctld timed out")
    assert "job" not in event_fields(ok) and "worker" not in event_fields(ok) and event_fields(ok)["slurm_step"] == "7.3"


class _Nodes(NoLauncher):
    """Hands out new node names and 'starts' them (no process); Slurm's unit of loss when asked."""

    def __init__(self, node_is_one_step: bool = False) -> None:
        super().__init__()
        self.node_is_one_step = node_is_one_step
        self.asked, self.started = 0, []

    def free_node(self) -> str:
        self.asked += 1
        return f"new{self.asked}"

    async def start_node(self, name, workers, coordinator, on_exit):
        await asyncio.sleep(0.01)  # the other refill runs meanwhile
        self.started.append(name)
        return [f"{name}.{j}" for j in range(workers)]


def _coordinator(tmp_path, launcher, *overrides):
    c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2", "cluster.workers_per_node=2", *overrides), str(tmp_path), launcher, "s" * 64, "job-test")
    c.members = membership(2, 2, 1)
    c.address = "127.0.0.1:1"
    training(c, 0, 1000.0)
    return c


@pytest.mark.parametrize("spare_nodes, started", [(1, ["new1"]), (2, ["new1", "new2"])])
def test_two_refills_asked_at_once_start_the_nodes_missing_once(tmp_path, spare_nodes, started):
    """A lost node's two ranks used one spare node: one node to start, however many refills are asked."""
    launcher = _Nodes()
    c = _coordinator(tmp_path, launcher, f"cluster.spare_nodes={spare_nodes}")
    for w in ("n1.0", "n1.1"):
        c.members.lose(w)
    c.members.assign({2: "s0.0", 3: "s0.1"})

    async def go() -> None:
        await asyncio.gather(c._refill(), c._refill())

    asyncio.run(go())
    c.events.close()
    assert launcher.started == started and launcher.asked == len(started)
    assert c.members.spare_nodes() == set(started)


@pytest.mark.parametrize("one_step", [True, False])
def test_a_lost_worker_takes_its_node_mates_where_a_node_is_one_step(tmp_path, one_step):
    """Slurm: the node's step ends with any of its workers: its ranks are one failure, at once.
    Locally a killed worker's neighbour lives on (a killed node's workers are each seen dying)."""
    launcher = _Nodes(node_is_one_step=one_step)
    c = _coordinator(tmp_path, launcher)
    c._lost(c.workers["n1.0"], "control connection closed (EOF)")
    c.events.close()
    if one_step:
        assert sorted(c.job.pending) == ["n1.0", "n1.1"] and launcher.killed == ["n1.0", "n1.1"]
        assert c.job.pending["n1.1"][0] == "its node's step ended with worker n1.0 (control connection closed (EOF))"
    else:
        assert sorted(c.job.pending) == ["n1.0"] and c.workers["n1.1"].role == "active"
    assert c.workers["n0.0"].role == "active" and c.workers["s0.0"].role == "spare"
