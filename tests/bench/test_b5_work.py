"""B5's pure parts (bench/b5.py): how a recovery's work grows with the world, from B7 points.

The measurement itself runs in the quick smoke (tests/bench/test_bench_smoke.py); here the
arithmetic that turns its points into the page's rows, exponents and verdicts, and the re-formation
growth that B6's simulation takes from it (and from a JSON of the earlier B5 of real workers).
"""

from __future__ import annotations

import math

import pytest

from bench import b5

pytestmark = pytest.mark.timeout(30)


def _point(ranks: int, cpu_ms: float, survivor_bytes: int, reformed_ms: float = 10.0) -> dict:
    by_type = {"recv abort": [1, 27], "recv assign": [1, 80], "sent held": [1, 97], "sent joining": [1, 58], "sent ready": [1, survivor_bytes - 262]}
    return {
        "ranks": ranks,
        "workers_per_node": 8,
        "recovery_cpu_net_ms": cpu_ms,
        "recovery_cpu_ms": cpu_ms + 5,
        "cpu_pct": 3.0,
        "assign_ms": cpu_ms,
        "reformed_ms": reformed_ms,
        "false_failures": 0,
        "startup_lost": 0,
        "survivor": {"messages": 5, "bytes": survivor_bytes, "by_type": by_type},
    }


def test_exponent_reads_flat_linear_and_quadratic():
    xs = [64, 256, 1024, 4096]
    assert b5.exponent(xs, [7.0] * 4) == pytest.approx(0.0)
    assert b5.exponent(xs, [0.03 * x for x in xs]) == pytest.approx(1.0)
    assert b5.exponent(xs, [1e-4 * x * x for x in xs]) == pytest.approx(2.0)
    assert b5.exponent([64], [1.0]) is None and b5.exponent(xs, [1.0, 0.0, 1.0, 1.0]) is None


def test_a_linear_coordinator_and_a_flat_survivor_reach_the_targets():
    pts = {"node": {n: [_point(n, 0.05 * n, 365), _point(n, 0.05 * n * 1.02, 366)] for n in (64, 256, 1024)}}
    res = b5.summarize(pts)
    g = res["growth"]["node"]
    assert g["coordinator_exponent"] == pytest.approx(1.0, abs=0.01) and g["coordinator_at_most_linear"] is True
    assert abs(g["survivor_bytes_growth_pct"]) < 1 and g["survivor_flat"] is True
    assert [r["ranks"] for r in res["rows"]] == [64, 256, 1024] and res["rows"][0]["nodes"] == 8 and res["rows"][0]["reps"] == 2
    assert b5.headline(res) == {
        "b5_coordinator_exponent": g["coordinator_exponent"],
        "b5_coordinator_exponent_rank": None,
        "b5_survivor_bytes_growth_pct": g["survivor_bytes_growth_pct"],
    }


def test_a_survivor_whose_messages_grow_with_the_world_is_not_flat():
    """What the earlier bug did (an assign that named every survivor): the survivor's bytes grow."""
    pts = {"rank": {n: [_point(n, 0.05 * n, 300 + 20 * n)] for n in (64, 256, 1024)}}
    g = b5.summarize(pts)["growth"]["rank"]
    assert g["survivor_flat"] is False and g["survivor_bytes_exponent"] > 0.5
    pts = {"rank": {n: [_point(n, 1e-4 * n * n, 365)] for n in (64, 256, 1024)}}
    assert b5.summarize(pts)["growth"]["rank"]["coordinator_at_most_linear"] is False  # quadratic


def test_b6_takes_the_reformation_growth_per_doubling_from_either_b5():
    new = b5.summarize({"node": {n: [_point(n, 1.0, 365, reformed_ms=10.0 + 5.0 * math.log2(n / 64))] for n in (64, 256, 1024)}})
    assert b5.group_init_per_doubling_s(new) == pytest.approx(0.005)
    old = {"rows": [{"workers": 2, "reconfigure_s": 0.02}, {"workers": 8, "reconfigure_s": 0.08}]}
    assert b5.group_init_per_doubling_s(old) == pytest.approx(0.03)
