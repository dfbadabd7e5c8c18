"""Helpers shared by the tests (a uniquely named module: every test directory has its own
conftest.py, so `from conftest import ...` would be ambiguous)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

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


def wait_for(
    what: str, condition: Callable[[], object], within_s: float, poll_s: float = 0.1, diagnose: Callable[[], str] | None = None
) -> object:
    """Poll ``condition`` until it returns something truthy (returned), or fail naming ``what``
    (with what ``diagnose`` says about the state of things at that moment)."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s} s waiting for {what}" + (f"\n{diagnose()}" if diagnose else ""))
        time.sleep(poll_s)
