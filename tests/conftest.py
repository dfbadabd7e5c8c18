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
