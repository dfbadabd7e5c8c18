"""A small chaos soak in CI: random schedules against the oracle (python -m ckptless_hpc.chaos),
with the whole state on every rank (ddp) and sharded (fsdp: copies on other nodes), and a job
that shrinks and grows back with its optimizer shards (zero, elastic=1: no spare, cluster.min_nodes=1;
ddp shrinking is proven case by case in test_elastic.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ckpt_testlib import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


# one schedule each for ddp and fsdp (CI time; `python -m ckptless_hpc.chaos runs=20` is the soak), two for the job that shrinks
@pytest.mark.parametrize("parallel,runs,seed,elastic", [("ddp", 1, 11, 0), ("fsdp", 1, 4, 0), ("zero", 2, 5, 1)])
def test_small_soak_keeps_the_oracle(tmp_path, parallel, runs, seed, elastic):
    p = subprocess.run(
        [sys.executable, "-m", "ckptless_hpc.chaos", f"runs={runs}", f"seed={seed}", f"parallel={parallel}", f"out={tmp_path}", f"elastic={elastic}"],
        capture_output=True, text=True, timeout=580, cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert report["options"]["parallel"] == parallel
    assert len(report["runs"]) == runs and all(r["ok"] and r["oracle"] for r in report["runs"])
    assert all(r["fired"] == r["planned"] == len(r["faults"]) for r in report["runs"]), report["runs"]  # every planned fault fired
    for r in report["runs"]:  # as each run's own event log says (the soak counts them from its summary)
        events = map(json.loads, (tmp_path / (f"run{r['run']:03d}" + (f"-redraw{r['attempt']}" if r["attempt"] else "")) / "events.jsonl").read_text().splitlines())
        assert {e["index"] for e in events if e["event"] == "fault_injected"} == set(range(r["planned"])), r
    assert f"{runs}/{runs} schedules kept the oracle with every planned fault fired" in p.stdout
    if elastic:  # no spare: every schedule's first loss shrank the job (a soak that never shrank would prove nothing here)
        assert all(r["spare_nodes"] == 0 and r["shrunk"] >= 1 for r in report["runs"]), report["runs"]
