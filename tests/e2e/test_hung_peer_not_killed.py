"""A hung peer that is not killed: frozen with SIGSTOP, every socket open, and the coordinator's
kill refused (tests/e2e/drivers/spare_the_hung.py). Its peers, blocked in the allreduce with it,
can only be released by the coordinator's abort: they must leave the collective within the
abort bound (cluster.abort_timeout_s), not after cluster.collective_timeout_s."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckpt_testlib import REPO, JobResult

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MLP = ("task=mlp", "train.steps=60")
DRIVER = REPO / "tests" / "e2e" / "drivers" / "spare_the_hung.py"


def test_survivors_leave_a_collective_with_a_frozen_unkilled_peer_by_the_abort(tmp_path, baseline):
    run_dir, kills = tmp_path / "run", tmp_path / "kills.jsonl"
    timing = ("cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5", "cluster.collective_timeout_s=120", "cluster.abort_timeout_s=5")
    cmd = [sys.executable, str(DRIVER), str(kills), f"hydra.run.dir={run_dir}", *MLP, *timing, "fault=hang", "fault.rank=0", "fault.step=30"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    res = JobResult(p.returncode, p.stdout + p.stderr, run_dir)
    ordered = [json.loads(line) for line in kills.read_text().splitlines()]
    hung = res.of("fault_injected")[0]
    try:
        assert res.rc == 0, res.out
        assert res.summary["final_state_sha256"] == baseline(*MLP)
        (rec,) = res.summary["recoveries"]
        assert rec["reasons"][0].startswith("no heartbeat")
        mine = [k for k in ordered if k["worker"] == hung["worker"]]
        assert mine[0]["state"] == "T" and not mine[0]["killed"], mine  # frozen, and left alive
        (resumed,) = res.of("resumed")
        later = [k for k in mine[1:] if k["killed"]]
        assert not later or later[0]["time"] > resumed["time"], mine  # alive and frozen until training went on
        # released by the abort: the survivor held and the group re-formed within the abort bound,
        # not after the 120 s collective timeout
        assert rec["reconfigure_s"] < 5, rec
    finally:
        for k in ordered:
            if k["pid"] and not k["killed"]:
                try:
                    os.kill(k["pid"], 9)
                except ProcessLookupError:
                    pass
