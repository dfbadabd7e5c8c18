"""Shared fixtures: run a real job (real coordinator, real worker processes) and read what it left."""

from __future__ import annotations

from typing import Dict, Tuple

import pytest

from ckpt_testlib import REPO, JobResult, run_job  # noqa: F401  (re-exported for fixtures)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """final_state_sha256 of the fault-free run of a config, computed once per config;
    ``baseline.result(...)``: that run itself (its events, its summary, its final model)."""
    cache: Dict[Tuple[str, ...], JobResult] = {}

    def result(*overrides: str, env: Dict[str, str] | None = None) -> JobResult:
        key = tuple(sorted(overrides)) + tuple(sorted((env or {}).items()))
        if key not in cache:
            res = run_job(tmp_path_factory.mktemp("baseline"), *overrides, "fault=none", env=env)
            assert res.rc == 0, res.out
            cache[key] = res
        return cache[key]

    def get(*overrides: str, env: Dict[str, str] | None = None) -> str:
        return result(*overrides, env=env).summary["final_state_sha256"]

    get.result = result  # type: ignore[attr-defined]
    return get


@pytest.fixture
def job(tmp_path):
    counter = iter(range(1000))

    def run(*overrides: str, timeout_s: float = 240, env: Dict[str, str] | None = None) -> JobResult:
        return run_job(tmp_path / f"run{next(counter)}", *overrides, timeout_s=timeout_s, env=env)

    return run


# Fixtures that start a real job (coordinator and worker processes): a test that uses one is an
# end-to-end test, marked so without being told, so that ``pytest -m "not e2e"`` is the fast tier.
JOB_FIXTURES = frozenset({"job", "baseline", "killed_run", "finished", "live_job", "start_job", "ema_baseline"})


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if JOB_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
