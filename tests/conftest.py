"""Shared fixtures: run a real job (real coordinator, real worker processes) and read what it left."""

from __future__ import annotations

from typing import Dict, Tuple

import pytest

from ckpt_testlib import REPO, JobResult, run_job  # noqa: F401  (re-exported for fixtures)


# Knobs that decide how a job watches, spares, refills and relays, never what it trains: a
# fault-free baseline leaves them out and starts no spare, so that the faulted runs that set them
# share one baseline per trained config (84 baselines were a fifth of the suite's time), and
# each faulted run is held to a run without its recovery machinery at all.
NOT_TRAINED = (
    "cluster.heartbeat_interval_s", "cluster.heartbeat_timeout_s", "cluster.collective_timeout_s", "cluster.recovery_timeout_s",
    "cluster.abort_timeout_s", "cluster.spare_nodes", "cluster.max_refills", "cluster.refill_spares", "cluster.control",
    "cluster.params_first", "cluster.straggler_action", "cluster.drain_failed_nodes", "train.log_every",
)  # fmt: skip


def trained(overrides: Tuple[str, ...]) -> Tuple[str, ...]:
    """The overrides that decide what a fault-free run trains (pure)."""
    return tuple(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in NOT_TRAINED)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """final_state_sha256 of the fault-free run of a config, computed once per config (what it
    trains: :func:`trained`; no spare); ``baseline.result(...)``: that run itself (its events,
    its summary, its final model)."""
    cache: Dict[Tuple[str, ...], JobResult] = {}

    def result(*overrides: str, env: Dict[str, str] | None = None) -> JobResult:
        kept = trained(overrides)
        key = tuple(sorted(kept)) + tuple(sorted((env or {}).items()))
        if key not in cache:
            res = run_job(tmp_path_factory.mktemp("baseline"), *kept, "fault=none", "cluster.spare_nodes=0", env=env)
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
