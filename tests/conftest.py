"""Shared fixtures: run a real job (real coordinator, real worker processes) and read what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass
class JobResult:
    rc: int
    out: str
    run_dir: Path

    @property
    def summary(self) -> Dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def events(self) -> List[Dict]:
        return [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]

    def of(self, kind: str) -> List[Dict]:
        return [e for e in self.events if e["event"] == kind]


def run_job(run_dir: Path, *overrides: str, timeout_s: float = 240, env: Dict[str, str] | None = None) -> JobResult:
    cmd = [sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", *overrides]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=None if env is None else {**os.environ, **env})
    return JobResult(p.returncode, p.stdout + p.stderr, run_dir)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """final_state_sha256 of the fault-free run of a config, computed once per config."""
    cache: Dict[Tuple[str, ...], str] = {}

    def get(*overrides: str) -> str:
        key = tuple(sorted(overrides))
        if key not in cache:
            res = run_job(tmp_path_factory.mktemp("baseline"), *overrides, "fault=none")
            assert res.rc == 0, res.out
            cache[key] = res.summary["final_state_sha256"]
        return cache[key]

    return get


@pytest.fixture
def job(tmp_path):
    counter = iter(range(1000))

    def run(*overrides: str, timeout_s: float = 240, env: Dict[str, str] | None = None) -> JobResult:
        return run_job(tmp_path / f"run{next(counter)}", *overrides, timeout_s=timeout_s, env=env)

    return run
