"""Many recoveries in one run: a fault every few seconds with spare refills, and the survivor's
open descriptors, threads and memory stay bounded (every generation's group and store client
are released once a later generation works).

CI runs 6 recoveries; ``CKPTLESS_SOAK_RECOVERIES=100 CKPTLESS_SOAK_EVERY=150 python3 -m pytest
tests/e2e/test_many_recoveries.py`` runs the long soak (docs/failure-semantics.md has its figures).

The job runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``): by default it rises
after the first large free, and large blocks freed during each recovery can then stay
in the heap as fragments: RSS grew 1.1 to 2.5 MB per recovery in four runs of this job at
N=6. Fixed, a large block goes back to the system when freed and RSS follows what the process
keeps alive: -0.05 to 0.21 MB per recovery in four runs (2026-12-01, a shared 2-core machine at
load 15-45), and a leak of 1 MB per recovery injected on purpose is over the bound at CI's 6.
"""

from __future__ import annotations

import os
import re

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

N = int(os.environ.get("CKPTLESS_SOAK_RECOVERIES", "6"))
EVERY = int(os.environ.get("CKPTLESS_SOAK_EVERY", "60"))  # steps between faults: the refilled spare (a process start) is ready in time
RSS_PER_RECOVERY_MB = 0.6  # least-squares growth over generations 1..N; measured -0.05 to 0.21 at N=6 (2026-12-01)
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}  # glibc's default threshold, kept fixed
CFG = (f"train.steps={EVERY * (N + 1)}", "train.log_every=100000", "cluster.spare_nodes=2", f"cluster.max_refills={N}", "cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=3")
LINE = re.compile(r"generation (\d+) formed: rank 0 of \d+ at step \d+; fds=(\d+) threads=(\d+) rss_mb=([\d.]+)")


def _schedule() -> tuple:
    faults = [f"{{kind:kill_worker,rank:1,step:{EVERY * (i + 1)}}}" for i in range(1, N)]
    return ("fault=kill_worker", "fault.rank=1", f"fault.step={EVERY}", f"fault.schedule=[{','.join(faults)}]")


def _per_generation(points: list) -> float:
    """The least-squares slope of ``(generation, value)`` points: what each generation adds. A
    leak adds its whole size per generation; one transient spike moves it by a fraction."""
    n = len(points)
    gx, vy = sum(g for g, _ in points) / n, sum(v for _, v in points) / n
    return sum((g - gx) * (v - vy) for g, v in points) / sum((g - gx) ** 2 for g, _ in points)


def test_survivor_resources_stay_bounded_over_many_recoveries(job, baseline):
    res = job(*CFG, *_schedule(), timeout_s=1700, env=ALLOCATOR)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert len(s["recoveries"]) == N and len(s["faults_fired"]) == N, (len(s["recoveries"]), s["faults_fired"])
    rows = [tuple(float(x) for x in m.groups()) for m in LINE.finditer((res.run_dir / "logs" / "local0.0.log").read_text())]
    assert [int(r[0]) for r in rows] == list(range(N + 1)), rows  # rank 0 survived every generation in one process
    first = rows[1]  # generation 1: the first recovery's steady state (generation 0 has no past)
    worst = {k: max(r[i] for r in rows[1:]) - first[i] for k, i in (("fds", 1), ("threads", 2))}
    assert worst["fds"] <= 3 and worst["threads"] <= 3, (worst, rows)  # nothing per generation (measured: +1 at most; one per recovery is +5 at 6)
    rss = _per_generation([(r[0], r[3]) for r in rows[1:]])  # from generation 1: generation 0 has no past
    assert rss <= RSS_PER_RECOVERY_MB, (f"RSS grows {rss:.2f} MB per recovery", rows)
    # the oracle (the fault-free run of a long soak outlasts the shared baseline's timeout)
    ref = baseline(*CFG) if N <= 10 else job(*CFG, "fault=none", timeout_s=1700).summary["final_state_sha256"]
    assert s["final_state_sha256"] == ref
