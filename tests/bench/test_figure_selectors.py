"""``python -m bench --check`` (bench/figures.py) refuses a marker whose key does not name one
value: a list selector ``[field=value]`` matching several rows of the JSON is an ambiguous
figure, never the first of them (issue 32, break 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.figures import KeyMissing, Results, check, lookup

pytestmark = pytest.mark.timeout(60)

#: two rows of B9's shrink with nodes=2 (a re-run appended, say), one with nodes=3
RES = {"b9": {"shrink": [{"nodes": 2, "mode": "ddp", "slowdown": 1.94}, {"nodes": 2, "mode": "zero", "slowdown": 2.31}, {"nodes": 3, "mode": "ddp", "slowdown": 1.47}]}}


def _results(tmp_path: Path) -> Results:
    (tmp_path / "only-b9.json").write_text(json.dumps(RES))
    return Results(tmp_path)


@pytest.mark.parametrize("quoted", ["1.94", "2.31"])
def test_a_selector_matching_two_rows_is_refused_whichever_row_the_page_quotes(tmp_path, quoted):
    """Issue 32, break 6: the check picking one of several rows a selector matches (the first):
    a page quoting either row would pass against a JSON that does not say which it is."""
    doc = f"<!-- bench:source only-b9.json -->\nfine x1.47<!--@ b9.shrink[nodes=3].slowdown -->\n2 -> 1 x{quoted}<!--@ b9.shrink[nodes=2].slowdown -->\n"
    problems, n = check(doc, _results(tmp_path))
    assert n == 2 and [p.line for p in problems] == [3], problems
    assert "2 items with nodes=2" in problems[0].what, problems[0].what
    with pytest.raises(KeyMissing, match=r"2 items with nodes=2 in b9.shrink\[nodes=2\].slowdown"):
        lookup(RES, "b9.shrink[nodes=2].slowdown")


def test_a_selector_made_unique_by_a_second_field_is_checked(tmp_path):
    doc = "<!-- bench:source only-b9.json -->\nddp x1.94<!--@ b9.shrink[nodes=2][mode=ddp].slowdown -->, zero x2.31<!--@ b9.shrink[nodes=2][mode=zero].slowdown -->\n"
    assert check(doc, _results(tmp_path)) == ([], 2)
    wrong = doc.replace("x2.31", "x1.94")
    problems, _ = check(wrong, _results(tmp_path))
    assert len(problems) == 1 and "quotes 1.94, but only-b9.json:b9.shrink[nodes=2][mode=zero].slowdown is 2.31" in problems[0].what, problems
