"""The bench section that measures a shard copy's CPU against its floor, with a holder landing
each copy in fresh memory or in the buffers of the copy it dropped (``python -m bench --only
copy_cost``, bench/copy_cost.py), works: every copy is acknowledged and kept, each landing gives
its figures. The figures themselves are quoted from its JSON and checked by ``--check``, never
asserted here (a loaded machine moves them)."""

from __future__ import annotations

import pytest

from bench import copy_cost

pytestmark = pytest.mark.timeout(300)


def test_the_copy_cost_section_measures_both_landings_against_the_floor():
    res = copy_cost.measure({"tiny": 300_000}, reps=2)
    (row,) = res["rows"]
    assert row["state_mb"] == pytest.approx(3.6) and row["floor"]["cpu_s"] > 0
    for kind in ("fresh", "landing"):
        assert set(row[kind]) == {"cpu_s", "wall_s", "cpu_over_floor"} and row[kind]["cpu_s"] > 0, row
    assert set(copy_cost.headline(res)) == {"copy_cpu_over_floor_fresh_tiny", "copy_cpu_over_floor_landing_tiny"}
    assert "landing cpu" in copy_cost.table(res)
