"""The planned-moves benchmark's smoke (bench/moves_bench.py --quick): a real drained job and a
real killed one, side by side, both ending with the fault-free hash; the table and JSON it writes."""

from __future__ import annotations

import json

import pytest

from bench import moves_bench, report

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_quick_moves_bench_drains_and_kills_bitwise_and_writes_its_json(tmp_path, capsys):
    assert moves_bench.main(["--quick", "--results", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "quick-moves.json").read_text())["moves"]
    assert res["oracle"] and res["moves_redone_steps"] == 0 and len(res["pairs"]) == 1
    (pair,) = res["pairs"]
    assert pair["move"]["downtime_s"] > 0 and pair["recovery"]["downtime_s"] > 0
    assert pair["move"]["planned_step"] > 200  # the drain was asked at step 200: its boundary is after
    assert "drain (planned move)" in capsys.readouterr().out and not (tmp_path / "tmp" / "moves").exists()
    (row,) = report.moves_rows(res)  # the quick run has no straggler part: one row in the table
    assert row[0].startswith("Planned move (drain) vs recovery") and row[3] == "yes", row
    assert report.moves_rows({"status": "skipped: not in the quick run"}) == [["Planned moves", "skipped: not in the quick run", "-", "n/a"]]
