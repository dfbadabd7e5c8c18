"""Start and poke the Slurm test cluster from pytest (tests/slurm_cluster/up.sh).

Policy: without root the cluster cannot start, and tests that need it are skipped
(`pytest.skip.Exception`). With ``CKPTLESS_REQUIRE_SLURM=1`` (CI) nothing is skipped:
a missing cluster fails the test with up.sh's output.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
UP_SH = HERE / "up.sh"
DOWN_SH = HERE / "down.sh"
REQUIRE_ENV = "CKPTLESS_REQUIRE_SLURM"
UP_TIMEOUT_S = 900.0  # a fresh machine runs apt-get update + install first
NODE_TIMEOUT_S = 90.0


def cluster_dir() -> Path:
    """The state dir up.sh uses (``CKPTLESS_SLURM_DIR``, default /tmp/ckptless-slurm)."""
    return Path(os.environ.get("CKPTLESS_SLURM_DIR", "/tmp/ckptless-slurm"))


def ensure_cluster(nodes: int = 4) -> dict[str, str]:
    """Start the cluster with `nodes` nodes (idempotent); return the env vars to use it.

    The result holds at least ``SLURM_CONF``; lay it over ``os.environ`` for Slurm
    commands (``monkeypatch.setenv`` or ``commands.*(env=...)``).
    """
    if os.geteuid() != 0:
        _unavailable("needs root to start the Slurm mini-cluster (tests/slurm_cluster/up.sh). "
                     "HINT: run the tests as root, or deselect them with -m 'not slurm'")
    rc, output = _run_script([str(UP_SH), str(nodes)], UP_TIMEOUT_S)
    if rc != 0:
        _unavailable(f"`bash {UP_SH} {nodes}` failed (rc={rc}); its output:\n{output}")
    return read_env_sh(cluster_dir() / "env.sh")


def crash_node(*names: str) -> str:
    """Hard failure of these nodes, in one instant: SIGKILL their slurmd, slurmstepd's and tasks."""
    return _must_run([str(DOWN_SH), "--crash-node", *names], NODE_TIMEOUT_S)


def start_node(name: str) -> str:
    """(Re)start one node's slurmd; returns once it responds again."""
    return _must_run([str(UP_SH), "--start-node", name], NODE_TIMEOUT_S)


def stop_cluster() -> str:
    """Cancel all jobs and stop every daemon up.sh started (down.sh)."""
    return _must_run([str(DOWN_SH)], UP_TIMEOUT_S)


def read_env_sh(path: Path) -> dict[str, str]:
    """``export KEY=VALUE`` lines of up.sh's env.sh as a dict."""
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            env[key.strip()] = value.strip()
    if "SLURM_CONF" not in env:
        raise RuntimeError(f"{path} exports no SLURM_CONF. HINT: rerun {UP_SH}")
    return env


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}\n({REQUIRE_ENV}=1: the Slurm tests must run, not skip)", pytrace=False)
    raise pytest.skip.Exception(reason, allow_module_level=True)


def _must_run(argv: list[str], timeout_s: float) -> str:
    rc, output = _run_script(argv, timeout_s)
    if rc != 0:
        raise RuntimeError(f"`bash {' '.join(argv)}` failed (rc={rc}); its output:\n{output}")
    return output


def _run_script(argv: list[str], timeout_s: float) -> tuple[int, str]:
    """Run a cluster script; output goes to a file, not a pipe: the daemons it starts
    must not hold our pipe open (we would wait for their exit)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            rc = subprocess.run(["bash", *argv], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        out.seek(0)
        text = out.read()
    if rc == 124:
        text += f"\n(timed out after {timeout_s} s)"
    return rc, text[-8000:]
