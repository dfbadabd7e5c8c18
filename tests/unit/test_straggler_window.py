"""The straggler detector judges a window of compute times per rank, never one sample: a
healthy rank hit by CPU noise is not flagged, a rank slow step after step is."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from ckptless_hpc.coordinator.detector import StragglerWindow, stragglers

pytestmark = pytest.mark.timeout(60)

RANKS = {0: "a.0", 1: "b.0", 2: "c.0"}


def _feed(w: StragglerWindow, step: int, times: dict) -> None:
    for r, t in times.items():
        w.add(RANKS[r], step, t)


def test_one_slow_sample_flags_nobody():
    w = StragglerWindow(size=8, min_samples=6)
    for step in range(8):
        _feed(w, step, {0: 0.010, 1: 0.010, 2: 0.010})
        assert w.judge(RANKS, 3.0) == {}
    _feed(w, 8, {0: 0.010, 1: 0.200, 2: 0.010})  # one step 20x slower: a preemption, a page fault
    assert stragglers({0: 0.010, 1: 0.200, 2: 0.010}, 3.0) == {1: pytest.approx(20.0)}  # what one sample says
    assert w.judge(RANKS, 3.0) == {}  # what the window says


def test_a_rank_slow_step_after_step_is_flagged_then_recovers():
    w = StragglerWindow(size=8, min_samples=6)
    for step in range(6):
        _feed(w, step, {0: 0.010, 1: 0.080, 2: 0.010})
    assert w.judge(RANKS, 3.0) == {1: pytest.approx(8.0)}
    for step in range(6, 14):
        _feed(w, step, {0: 0.010, 1: 0.025, 2: 0.010})  # 2.5x: under the factor, above halfway
    assert w.judge(RANKS, 3.0) == {}
    assert w.judge(RANKS, 3.0, flagged=[1]) == {1: pytest.approx(2.5)}  # once flagged, no flapping at the line
    for step in range(14, 22):
        _feed(w, step, {0: 0.010, 1: 0.010, 2: 0.011})
    assert w.judge(RANKS, 3.0, flagged=[1]) == {}


def test_too_few_samples_are_not_judged():
    w = StragglerWindow(size=8, min_samples=6)
    for step in range(5):
        _feed(w, step, {0: 0.010, 1: 0.5, 2: 0.010})
    assert w.judge(RANKS, 3.0) == {}


def test_a_repeated_heartbeat_of_the_same_step_counts_once():
    w = StragglerWindow(size=8, min_samples=6)
    for _ in range(10):  # ten heartbeats while the rank sits at step 5 (a slow step, or idle)
        w.add("b.0", 5, 0.5)
    assert "b.0" not in w.times
    w.add("b.0", None, 0.5)
    w.add("b.0", 6, None)
    w.add("b.0", 7, 0.0)
    assert len(w._samples["b.0"]) == 1


def test_a_replaced_rank_starts_a_new_window():
    w = StragglerWindow(size=8, min_samples=6)
    for step in range(8):
        _feed(w, step, {0: 0.010, 1: 0.080, 2: 0.010})
    assert 1 in w.judge(RANKS, 3.0)
    assert w.judge({**RANKS, 1: "spare.0"}, 3.0) == {}  # the spare on rank 1 has no samples yet
    w.forget("b.0")
    assert "b.0" not in w.times


def test_injected_noise_never_flags_a_healthy_rank():
    """Every rank healthy, each step a 1-in-5 chance per rank of a 2-30x spike (CPU noise on a
    shared machine; the single-sample rule flags someone at about one step in two): over
    thousands of steps the window never flags anyone; a rank slowed 8x in the same noise is
    flagged within the window."""
    rng = random.Random(13)
    w = StragglerWindow(size=8, min_samples=6)

    def noisy(base: float) -> float:
        return base * (rng.uniform(2, 30) if rng.random() < 0.2 else rng.uniform(0.9, 1.1))

    single = 0
    for step in range(3000):
        times = {r: noisy(0.010) for r in RANKS}
        _feed(w, step, times)
        single += bool(stragglers(times, 3.0))
        assert w.judge(RANKS, 3.0) == {}, f"step {step}: {w.times}"
    assert single > 1000  # the noise is real: one sample at a time, healthy ranks were flagged
    for step in range(3000, 3008):
        _feed(w, step, {0: noisy(0.010), 1: noisy(0.080), 2: noisy(0.010)})
    assert list(w.judge(RANKS, 3.0)) == [1]


def test_real_cpu_noise_never_flags_a_healthy_rank():
    """Real compute times of the same work, measured while two busy processes compete for the
    machine's cores: the window flags nobody; the rank doing 8x the work is flagged."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]

    def work(n: int) -> float:
        t0 = time.perf_counter()
        x = 0
        for i in range(n):
            x += i * i
        return time.perf_counter() - t0

    order = random.Random(5)
    UNIT = 100_000  # ~8 ms here: longer than the scheduler's time slices, which then hit every rank's time alike (at 1 ms they hit one in three)

    def measured(loads: dict) -> dict:
        """Each rank's time, measured in a new order every step: real ranks run side by side, and a
        fixed order lets the scheduler's time slices fall on the same rank step after step."""
        ranks = list(loads)
        order.shuffle(ranks)
        return {r: work(loads[r]) for r in ranks}

    try:
        w = StragglerWindow(size=8, min_samples=6)
        flagged = []
        for step in range(60):
            _feed(w, step, measured({0: UNIT, 1: UNIT, 2: UNIT}))
            flagged.append(w.judge(RANKS, 3.0))
        assert not any(flagged), [f for f in flagged if f]
        for step in range(60, 68):
            _feed(w, step, measured({0: UNIT, 1: 8 * UNIT, 2: UNIT}))
        assert list(w.judge(RANKS, 3.0)) == [1], w.times
    finally:
        for b in burners:
            b.kill()
            b.wait()
