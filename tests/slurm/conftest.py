"""The real Slurm mini-cluster for every test here (tests/slurm_cluster/up.sh).

Without root the tests skip with the reason; with CKPTLESS_REQUIRE_SLURM=1 (the test command
sets it as root, so in CI) a cluster that cannot start fails them instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest


def _load_cluster_fixture():
    path = Path(__file__).resolve().parents[1] / "slurm_cluster" / "fixture.py"
    spec = importlib.util.spec_from_file_location("ckptless_tests_slurm_cluster_fixture", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


cluster = _load_cluster_fixture()


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    env = cluster.ensure_cluster(4)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield env


@pytest.fixture(scope="session")
def slurm_cluster():
    """The cluster controls: ensure_cluster, crash_node, start_node, stop_cluster."""
    return cluster
