"""B2 runs in every full run: without torchft the full run's B2 fails (and with it the run);
only the quick smoke skips it. Nothing is started: the check comes before any job."""

from __future__ import annotations

import pytest

from bench import torchft_bench
from bench.common import BenchError
from bench.plan import FULL, QUICK
from bench.run import Bench

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def no_torchft(monkeypatch):
    monkeypatch.setattr(torchft_bench, "available", lambda: "ModuleNotFoundError: No module named 'torchft'")


def test_a_full_run_without_torchft_fails_b2_with_the_set_up_to_run(no_torchft, tmp_path):
    with pytest.raises(BenchError, match=r"B2 needs torchft .*HINT: bash bench/setup.sh"):
        Bench(FULL, tmp_path).b2({})


def test_the_quick_smoke_skips_b2_without_torchft(no_torchft, tmp_path):
    out = Bench(QUICK, tmp_path).b2({})
    assert out["status"] == "skipped: torchft not installed" and "torchft" in out["reason"]
