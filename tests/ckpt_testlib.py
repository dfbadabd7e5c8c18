"""Helpers shared by the tests (a uniquely named module: every test directory has its own
conftest.py, so `from conftest import ...` would be ambiguous)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from ckptless_hpc.slurm.watch import wait_for  # noqa: F401  (shared with the chaos driver)

REPO = Path(__file__).resolve().parents[1]
# CKPTLESS_FULL=1: also the variants CI leaves out to keep its time (a mode whose path another
# test already proves in CI); the test command runs them with it set (README)
FULL = os.environ.get("CKPTLESS_FULL") == "1"


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


def most_spare_nodes(events: List[Dict]) -> int:
    """The most nodes holding an idle hot spare at any moment of a run, replayed from its events:
    a refill that counts ranks (or runs twice at once) shows as more than ``cluster.spare_nodes``."""
    idle: Dict[str, set] = {}  # node -> its idle spare workers
    most = 0
    for e in events:
        kind = e["event"]
        if kind == "node_started" and e["role"] == "spare":
            idle[e["node"]] = {f"{e['node']}.{j}" for j in range(e["workers"])}
        elif kind in ("spare_promoted", "failure_detected") and e.get("worker"):
            idle.get(e["worker"].rpartition(".")[0], set()).discard(e["worker"])
        elif kind == "node_excluded":
            idle.pop(e["node"], None)
        most = max(most, sum(1 for workers in idle.values() if workers))
    return most


def fill_up(fs: Path, chunk: int = 4096) -> OSError:
    """Write into ``fs`` until the filesystem refuses; the error it refused with (ENOSPC for a
    full one): it is full for everyone after this."""
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * chunk):
            pass
    except OSError as e:
        return e
    finally:
        os.close(fd)
    raise AssertionError(f"{fs} took every write")



def restore_through_dcp(model, optimizer, path) -> None:
    """docs/tasks.md's recipe, word for word: a DCP checkpoint of the job's into ``model`` and
    ``optimizer`` (freshly built by the task) with torch's own API alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(sd, checkpoint_id=str(path))
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
