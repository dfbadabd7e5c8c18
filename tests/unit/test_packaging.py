"""The wheel carries the Hydra configs (as ckptless_hpc.conf) and the corpus; an installed copy,
away from the repo, composes its config and runs."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def test_installed_wheel_has_configs_and_runs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)], check=True, timeout=200)
    (wheel,) = tmp_path.glob("ckptless_hpc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("ckptless_hpc/conf/config.yaml", "ckptless_hpc/conf/cluster/slurm.yaml", "ckptless_hpc/conf/task/lm.yaml", "ckptless_hpc/conf/fault/hang.yaml", "ckptless_hpc/tasks/data/corpus.txt"):
        assert f in names, f
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True, timeout=120)
    env = dict(os.environ, PYTHONPATH=str(target))
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc", "dry_run=true", "task=mlp", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "configuration valid" in p.stdout
    p = subprocess.run([sys.executable, "-c", "import ckptless_hpc; print(ckptless_hpc.__file__)"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.stdout.startswith(str(target))
