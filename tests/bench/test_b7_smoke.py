"""B7's CI smoke: the real coordinator under a few hundred simulated ranks (``python -m bench
--only b7 --quick``). No duration or ratio is asserted (benchmarks measure speed); what is
asserted is behaviour, with a node's relay per simulated node and without: every rank of the
burst got in, nobody alive was declared dead, the closed connection was recovered from, and
every figure B7 reports is there and finite."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def test_b7_quick_runs_the_coordinator_under_simulated_ranks(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench", "--only", "b7", "--quick", "--results", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=380)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    b7 = json.loads((tmp_path / "only-b7.json").read_text())["b7"]
    assert sorted(pt["control"] for pt in b7["points"]) == ["node", "rank"]  # with relays and without, side by side
    for pt in b7["points"]:
        assert pt["ranks"] == 300 and pt["processes"] >= 2
        assert pt["startup_lost"] == 0 and pt["false_failures"] == 0, pt
        assert pt["status"] == "cancelled"  # ended by the harness after the recovery
        for key in ("cpu_pct", "hb_delay_p99_ms", "detect_ms", "abort_ms", "assign_ms", "reformed_ms", "resumed_ms", "startup_s"):
            assert isinstance(pt[key], (int, float)) and math.isfinite(pt[key]) and pt[key] >= 0, (key, pt[key])
        assert pt["detect_ms"] <= pt["abort_ms"] <= pt["assign_ms"] <= pt["resumed_ms"], pt
    assert b7["metrics"]["step_log_entries"] <= 256 and b7["metrics"]["ratio_1m_vs_1k"] > 0
    assert "| 300 | node |" in p.stdout and "| 300 | rank |" in p.stdout
