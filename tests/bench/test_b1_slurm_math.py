"""The pure part of B1 on Slurm (bench/slurm_path.py): when the fault was, and the medians.

The measurement itself needs root and the mini-cluster (``python -m bench --only b1_slurm``);
the real-Slurm path it measures is tested in tests/slurm/test_slurm_training.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import BenchError, JobRun
from bench.slurm_path import crash_time, point, summarize

pytestmark = pytest.mark.timeout(30)


def test_the_crash_instant_is_down_sh_s_own_stamp():
    out = "[down.sh 11:49:01] n2 frozen: slurmd=123 ...\n[down.sh 11:49:01] n2 crashed at 1796125292.351234567\n"
    assert crash_time(out) == pytest.approx(1796125292.351234567)
    with pytest.raises(BenchError, match="did not say when"):
        crash_time("[down.sh] n2: nothing running")


def _run(t_fault: float, scancel_s: float, sha: str) -> JobRun:
    rec = {"t_detect": t_fault + 0.01, "t_resumed": t_fault + 0.2, "detect_s": 0.0, "reconfigure_s": 0.02, "transfer_s": 0.05,
           "resume_s": 0.12, "bytes_transferred": 5, "downtime_s": 0.19}
    events = [
        {"event": "spare_promoted", "time": t_fault + 0.013},
        {"event": "scheduler_command", "time": t_fault + 6.1, "action": "cancel_step", "node": "n2", "seconds": scancel_s, "started_at": t_fault + 0.05},
    ]
    summary = {"recoveries": [rec], "coordinator_stalls": {"worst_s": 0.0}, "final_state_sha256": sha}
    return JobRun(Path("/nonexistent"), summary, events, 1.0)


def test_a_point_dates_the_downtime_from_the_fault_and_reads_the_scancel():
    p = point("crash", _run(100.0, 6.0, "abc"), 100.0, "n2")
    assert p["downtime_s"] == pytest.approx(0.2) and p["fault_to_detect_s"] == pytest.approx(0.01)
    assert p["scancel_s"] == 6.0 and p["scancel_after_promotion"] is True


def test_the_summary_compares_with_the_local_killed_worker_and_checks_the_oracle():
    crash = [point("crash", _run(100.0 + i, 6.0, "abc"), 100.0 + i, "n2") for i in range(3)]
    step = [point("step", _run(200.0, 0.03, "abc"), 200.0, "n2")]
    local = [JobRun(Path("/nonexistent"), {"recoveries": [{"downtime_s": d, "detect_s": 0.001, "reconfigure_s": 0.01, "transfer_s": 0.02, "resume_s": 0.05}]}, [], 1.0)
             for d in (0.08, 0.1, 0.12)]
    out = summarize(crash, step, local, "abc")
    assert out["local_kill"]["downtime_s"] == pytest.approx(0.1)
    assert out["crash_over_local_s"] == pytest.approx(0.1) and out["crash"]["oracle"] and out["crash"]["reps"] == 3
    assert not summarize(crash, step, local, "other")["step"]["oracle"]
