"""The reference a user can run: a real job (2 ranks, real processes), then
``python -m ckptless_hpc.reference <the same overrides> --compare RUN_DIR`` in a process of its
own, as a user runs it: the table of every tensor and exit 0; a copy of the run with one tensor
moved by 1e-3 of its magnitude exits 1 and names that tensor first. The same run shows the
global batch on its start line, and a new job resumed from its periodic copy says it loaded a
periodic copy (not "the emergency copy") and still trains what the reference trains.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ckpt_testlib import REPO, run_job
from ckptless_hpc.rundir.paths import RunPaths

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

CFG = ("task=mlp", "train.steps=6", "cluster.nodes=2", "train.save_every=3")
FAST_HB = ("cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")


def _reference(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptless_hpc.reference", *args], capture_output=True, text=True, timeout=240, cwd=REPO)


def _rows(stdout: str) -> list:
    """The table's rows (tensor, difference), in the printed order."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("tensor"))
    rows = []
    for line in lines[head + 1 :]:
        if line.startswith(("within", "beyond")):
            break
        rows.append(tuple(line.split()[:2]))
    return rows


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    res = run_job(tmp_path_factory.mktemp("reference") / "run", *CFG, *FAST_HB)
    assert res.rc == 0, res.out[-4000:]
    return res


def test_the_reference_trains_what_the_job_trained(finished):
    # every job's start line shows the global batch (docs/tasks.md, "Check it in a second")
    assert "global batch: batch_size 16 x grad_accum 1 x world 2 = 32 samples per step" in finished.out, finished.out[-3000:]
    model = torch.load(RunPaths(str(finished.run_dir)).final_model, weights_only=True)
    p = _reference(*CFG, *FAST_HB, "--compare", str(finished.run_dir))
    assert p.returncode == 0, (p.stdout, p.stderr)
    rows = _rows(p.stdout)
    assert sorted(name for name, _ in rows) == sorted(model), p.stdout
    # two ranks, one micro-batch, no clipping: the job's sums are the loop's (docs/tasks.md, "The determinism contract")
    assert all(float(d) == 0.0 for _, d in rows) and "(every tensor equal)" in p.stdout, p.stdout
    # no overrides: the run's own .hydra/config.yaml
    p = _reference("--compare", str(finished.run_dir))
    assert p.returncode == 0 and "config: the run's own" in p.stdout, (p.stdout, p.stderr)


def test_a_perturbed_model_is_beyond_the_tolerance_and_named(finished, tmp_path):
    copy = tmp_path / "perturbed"
    shutil.copytree(finished.run_dir, copy)
    path = RunPaths(str(copy)).final_model
    state = torch.load(path, weights_only=True)
    name = sorted(k for k, v in state.items() if v.is_floating_point())[-1]
    state[name] = state[name] * (1 + 1e-3)
    torch.save(state, path)
    p = _reference(*CFG, "--compare", str(copy), "--tol", "1e-5")
    assert p.returncode == 1, (p.stdout, p.stderr)
    rows = _rows(p.stdout)
    assert rows[0][0] == name and 0.9e-3 < float(rows[0][1]) < 1.1e-3, p.stdout
    assert all(float(d) <= 1e-5 for _, d in rows[1:]), p.stdout
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("beyond the tolerance: 1 of") and name in last and "HINT" in last, last


def test_a_job_resumed_from_a_periodic_copy_says_so(finished, job):
    saved = RunPaths(str(finished.run_dir)).saved_step(3)
    assert os.path.isdir(saved), os.listdir(finished.run_dir)
    res = job(*CFG, *FAST_HB, f"resume_from={saved}")
    assert res.rc == 0, res.out[-4000:]
    logs = "".join(open(f).read() for f in glob.glob(os.path.join(RunPaths(str(res.run_dir)).logs, "*.log")))
    assert "loaded a periodic copy of step 3 from" in logs, logs[-3000:]
    assert "loaded the emergency copy" not in logs
    # the resumed run trained what the uninterrupted one did: the reference trains it from step 0
    p = _reference(*CFG, f"resume_from={saved}", "--compare", str(res.run_dir))
    assert p.returncode == 0 and "note: resume_from=" in p.stdout, (p.stdout, p.stderr)
