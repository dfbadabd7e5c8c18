"""The bench's table rows (pure): a missing figure is shown as such, never a crash."""

from __future__ import annotations

import pytest

from bench.report import b8_rows

pytestmark = pytest.mark.timeout(30)


def test_b8_row_without_a_cpu_figure_says_n_a():
    """A run too short to sample its CPU has no copy CPU figure (None in the JSON): the table says
    n/a instead of failing the whole run at its last line (it did on a loaded machine)."""
    floor = {"blocked_pct_of_step": 3.0, "copy_cpu_s_per_step": None, "floor_s_per_step": 0.001, "cpu_over_floor": None}
    row = {"factor": 1, "mode": "zero", "params": 1e5, "step_s_no_copies": 0.01, "step_s_copies": 0.02, "overhead_pct": 5.0, "pair_ratios": [1.1], "floor": floor}
    (cells,) = b8_rows({"overhead": [row]})
    assert "copy CPU n/a ms/step" in cells[1] and cells[3].endswith("n/a"), cells
