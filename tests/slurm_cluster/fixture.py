"""Start and poke the Slurm test cluster from pytest (tests/slurm_cluster/up.sh).

The controls are ``ckptless_hpc.slurm.minicluster`` (shared with ``python -m ckptless_hpc.chaos
cluster=slurm``); this adds the tests' policy: without root the cluster cannot start, and tests
that need it are skipped (`pytest.skip.Exception`). With ``CKPTLESS_REQUIRE_SLURM=1`` (CI)
nothing is skipped: a missing cluster fails the test with up.sh's output.
"""

from __future__ import annotations

import os

import pytest

from ckptless_hpc.slurm.minicluster import (
    ClusterError,
    cluster_dir,
    crash_node,
    kill_slurmd,
    read_env_sh,
    restore,
    start_node,
    stop_cluster,
)
from ckptless_hpc.slurm import minicluster

__all__ = ["ClusterError", "cluster_dir", "crash_node", "ensure_cluster", "kill_slurmd", "read_env_sh", "restore", "start_node", "stop_cluster"]
REQUIRE_ENV = "CKPTLESS_REQUIRE_SLURM"


def ensure_cluster(nodes: int = 4) -> dict[str, str]:
    """Start the cluster with `nodes` nodes (idempotent); return the env vars to use it.

    The result holds at least ``SLURM_CONF``; lay it over ``os.environ`` for Slurm
    commands (``monkeypatch.setenv`` or ``commands.*(env=...)``).
    """
    try:
        return minicluster.ensure_cluster(nodes)
    except ClusterError as e:
        _unavailable(str(e))
        raise


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}\n({REQUIRE_ENV}=1: the Slurm tests must run, not skip)", pytrace=False)
    raise pytest.skip.Exception(reason, allow_module_level=True)
