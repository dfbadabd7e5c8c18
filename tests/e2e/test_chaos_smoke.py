"""A small chaos soak in CI: random schedules against the oracle (python -m ckptless_hpc.chaos)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ckpt_testlib import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_small_soak_keeps_the_oracle(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc.chaos", "runs=3", "seed=11", f"out={tmp_path}"], capture_output=True, text=True, timeout=580, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert len(report["runs"]) == 3 and all(r["ok"] and r["oracle"] for r in report["runs"])
    assert all(r["fired"] == r["planned"] == len(r["faults"]) for r in report["runs"]), report["runs"]  # every planned fault fired
    assert "3/3 schedules kept the oracle with every planned fault fired" in p.stdout
