"""The small pieces the coordinator's server is a shell around, tested without sockets or
processes: waiting on its state (wakeup.py), reporting stragglers once (detector.py), echoing
the console rank's log (progress.py) and describing a scheduler command's outcome."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ckptless_hpc.coordinator.detector import StragglerWatch, StragglerWindow
from ckptless_hpc.coordinator.wakeup import Wakeup
from ckptless_hpc.launch.background import describe, event_fields
from ckptless_hpc.progress import ConsoleEcho, Progress

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
