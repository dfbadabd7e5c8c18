"""``python -m ckptless_hpc report|status|logs|cancel|export`` is ``ckptless-hpc ...`` (README,
"Commands"): the module entry dispatches the tools as the console script does, and
``python -m ckptless_hpc.reference`` has its own help. Real subprocesses, as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckpt_testlib import REPO
from ckptless_hpc.cli import TOOLS

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_python_m_runs_each_tool(tool):
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc", tool, "--help"], capture_output=True, text=True, timeout=90, cwd=REPO)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert tool in p.stdout and "usage" in p.stdout.lower(), p.stdout


def test_python_m_ckptless_hpc_status_of_a_non_run_dir_exits_2_with_a_hint(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc", "status", str(tmp_path)], capture_output=True, text=True, timeout=90, cwd=REPO)
    assert p.returncode == 2 and "HINT" in p.stdout + p.stderr, (p.stdout, p.stderr)


def test_python_m_reference_help():
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc.reference", "--help"], capture_output=True, text=True, timeout=90, cwd=REPO)
    assert p.returncode == 0 and "--compare RUN_DIR" in p.stdout and "--tol" in p.stdout, (p.stdout, p.stderr)
