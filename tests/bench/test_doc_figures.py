"""README.md and docs/*.md quote only figures that bench/results/ holds (``python -m bench --check``).

The first test runs the check on the committed pages and results, so the test command and CI
fail when a figure of any page is not in the JSON it names, and it checks the count of package
commits the quoted run is behind HEAD that the check prints; the others show that the check
catches a wrong figure, a wrong key, a missing file and a stale table, each with its page and line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import verdict
from bench.figures import KeyMissing, Results, check, lookup, matches, quoted, render

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_the_committed_pages_quote_only_what_their_json_holds():
    p = subprocess.run([sys.executable, "-m", "bench", "--check"], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    n = int(p.stdout.split("all ")[1].split()[0])
    assert n >= 40, p.stdout  # the page's figures are marked, not a handful of them
    # every page that quotes a measurement is read, not only docs/benchmarks.md
    for page in ("README.md", "docs/benchmarks.md", "docs/sharding.md", "docs/concepts.md", "docs/failure-semantics.md", "docs/slurm.md"):
        assert f"{page} (" in p.stdout, (page, p.stdout[-2000:])
    # how far the quoted run is behind HEAD, counted now
    core = json.loads((REPO / "bench" / "results" / "latest.json").read_text())["machine"]["core_commit"]
    want = subprocess.run(["git", "-C", str(REPO), "rev-list", "--count", f"{core}..HEAD", "--", "ckptless_hpc"], capture_output=True, text=True, timeout=30)
    if want.returncode == 0:
        assert f"latest.json measured core {core[:7]}: HEAD is {int(want.stdout)} package commit(s) past it" in p.stdout, p.stdout[-2000:]
    else:  # not a git checkout holding that commit (an sdist, a shallow clone): said, not guessed
        assert "could not count" in p.stdout, p.stdout[-2000:]


def test_a_wrong_figure_on_any_page_fails_with_its_page_and_line(tmp_path):
    _results(tmp_path)
    a, b = tmp_path / "README.md", tmp_path / "other.md"
    a.write_text("<!-- bench:source only-x.json -->\nB4 90 %<!--@ b4.fraction_of_loopback x100 -->\n")
    b.write_text("no figure here\nB4 82 %<!--@ only-x.json:b4.fraction_of_loopback x100 -->\n")
    (tmp_path / "plain.md").write_text("a page without markers: nothing to check, not an error\n")
    cmd = [sys.executable, "-m", "bench", "--check", "--results", str(tmp_path)] + [f"--doc={d}" for d in (a, b, tmp_path / "plain.md")]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=100)
    assert p.returncode == 1 and f"{b}:2: " in p.stdout and f"{a}:" not in p.stdout and "plain.md:" not in p.stdout, p.stdout
    b.write_text("B4 91 %<!--@ only-x.json:b4.fraction_of_loopback x100 -->\n")  # 90.32 rounds to 90
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=100)
    assert p.returncode == 1 and "quotes 91, but" in p.stdout
    b.write_text("B4 90 %<!--@ only-x.json:b4.fraction_of_loopback x100 -->\n")
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and "all 2 marked figures and tables of 2 page(s)" in p.stdout, p.stdout


RES = {"b3": {"overhead_pct": 1.04, "pair_ratios": [1.021, 0.988, 1.036]}, "b1": {"points": [{"size": "10M", "kill": {"downtime_s": 3.3495}}]},
       "b4": {"fraction_of_loopback": 0.9032}}


def _results(tmp_path: Path) -> Results:
    (tmp_path / "only-x.json").write_text(json.dumps(RES))
    return Results(tmp_path)


def test_figures_that_match_pass(tmp_path):
    doc = "\n".join([
        "<!-- bench:source only-x.json -->",
        "B3 +1.0 %<!--@ b3.overhead_pct --> and pairs 0.988<!--@ b3.pair_ratios|min -->-1.036<!--@ b3.pair_ratios|max -->,",
        "kill 3.35 s<!--@ only-x.json:b1.points[size=10M].kill.downtime_s -->, B4 90 %<!--@ b4.fraction_of_loopback x100 -->",
    ])
    problems, n = check(doc, _results(tmp_path))
    assert problems == [] and n == 5


@pytest.mark.parametrize("line, why", [
    ("B3 +1.2 %<!--@ b3.overhead_pct -->", "quotes 1.2, but only-x.json:b3.overhead_pct is 1.04"),
    ("B3 -1.0 %<!--@ b3.overhead_pct -->", "quotes -1, but"),
    ("B3 +1.0 %<!--@ b3.overhead -->", "which is not there"),
    ("kill 3.35 s<!--@ b1.points[size=100M].kill.downtime_s -->", "0 items with size=100M"),
    ("B3 +1.0 %<!--@ only-b3.json:b3.overhead_pct -->", "does not exist"),
    ("pairs<!--@ b3.pair_ratios -->", "no number before"),
    ("pairs 0.99<!--@ b3.pair_ratios -->", "not a number"),
])
def test_a_figure_its_json_does_not_hold_is_listed_with_its_line(tmp_path, line, why):
    doc = "<!-- bench:source only-x.json -->\nfine 1.04<!--@ b3.overhead_pct -->\n" + line + "\n"
    problems, _ = check(doc, _results(tmp_path))
    assert [p.line for p in problems] == [3], problems
    assert why in problems[0].what, problems[0].what


def test_a_marker_without_a_file_is_refused(tmp_path):
    problems, _ = check("B3 +1.0 %<!--@ b3.overhead_pct -->", _results(tmp_path))
    assert "names no JSON file" in problems[0].what


def test_a_stale_table_fails_and_render_docs_rewrites_it(tmp_path):
    res = json.loads((REPO / "bench" / "results" / "latest.json").read_text())
    (tmp_path / "latest.json").write_text(json.dumps(res))
    doc = "# x\n<!-- bench:table b8_recover latest.json -->\n| stale |\n<!-- /bench:table -->\nafter\n"
    problems, _ = check(doc, Results(tmp_path))
    assert len(problems) == 1 and problems[0].line == 3 and "table b8_recover" in problems[0].what
    fresh = render(doc, Results(tmp_path))
    assert fresh.startswith("# x\n<!-- bench:table b8_recover latest.json -->\n| mode |") and fresh.endswith("<!-- /bench:table -->\nafter\n")
    assert check(fresh, Results(tmp_path)) == ([], 1)


def test_the_command_fails_with_the_line_and_a_hint(tmp_path):
    _results(tmp_path)
    doc = tmp_path / "page.md"
    doc.write_text("<!-- bench:source only-x.json -->\n\nB4 82 %<!--@ b4.fraction_of_loopback x100 -->\n")
    p = subprocess.run([sys.executable, "-m", "bench", "--check", "--doc", str(doc), "--results", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert p.returncode == 1
    assert f"{doc}:3: " in p.stdout and "quotes 82, but only-x.json:b4.fraction_of_loopback x100 is 90.32" in p.stdout and "HINT" in p.stdout


def test_lookup_quoted_matches():
    assert lookup(RES, "b1.points.0.kill.downtime_s") == 3.3495
    assert lookup(RES, "b3.pair_ratios|len") == 3
    with pytest.raises(KeyMissing):
        lookup(RES, "b3.pair_ratios|sum")
    assert quoted("x 1,790 MB and 3.35") == (3.35, 2) and quoted("1,790") == (1790.0, 0) and quoted("\u22126.8") == (-6.8, 1)
    assert quoted("pairs 0.988-1.036") == (1.036, 3) and quoted("growth -5%") == (-5.0, 0)
    assert matches(3.35, 2, 3.3495) and not matches(3.34, 2, 3.3495) and matches(73, 0, 72.598) and not matches(72, 0, 72.598)
    assert not matches(6.8, 1, -6.79)


def test_verdict_only_when_every_pair_agrees():
    assert verdict([0.5, 1.9, -3.0], 2.0) == "yes"
    assert verdict([2.5, 14.0], 2.0) == "NO"
    assert verdict([66.3, -33.4, 12.7, -6.8, -55.3], 2.0) == "unresolved at this load"  # B3's pairs of the 2026-12-01 run
    assert verdict([], 2.0) == "n/a"
