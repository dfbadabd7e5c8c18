"""The report: text numbers equal summary.json's, the chart is drawn from a real run's events,
several runs give one table; and the pure folding of events (ranks per generation, recoveries,
requeue attempts) on hand-written event lists."""

from __future__ import annotations

import io
import json
import re
import shutil
import struct

import pytest

from ckpt_testlib import run_job
from ckptless_hpc.tools import report, commands
from ckptless_hpc.rundir.read import RunDirError, load_run, parse_events, progress, rank_history, recoveries, requeues, split_attempts, step_series

pytestmark = [pytest.mark.timeout(120)]

MLP = ("task=mlp", "train.steps=40", "cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """One real run (coordinator + worker processes) with rank 1 killed at step 15."""
    res = run_job(tmp_path_factory.mktemp("report") / "run", *MLP, "fault=kill_worker", "fault.rank=1", "fault.step=15", timeout_s=110)
    assert res.rc == 0, res.out
    return res.run_dir


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_text_numbers_equal_summary(killed_run):
    run = load_run(str(killed_run))
    s = run.summary
    text = report.run_text(run, now=0.0)
    (rec,) = s["recoveries"]
    m = re.search(r"downtime\s+([\d.]+) s = detect ([\d.]+) \+ reconfigure ([\d.]+) \+ transfer ([\d.]+) \+ resume ([\d.]+)", text)
    assert m, text
    got = [float(x) for x in m.groups()]
    assert got == [rec["downtime_s"], rec["detect_s"], rec["reconfigure_s"], rec["transfer_s"], rec["resume_s"]]
    gp = float(re.search(r"goodput\s+([\d.]+)%", text).group(1))
    assert gp == pytest.approx(100 * s["goodput"], abs=1e-9)
    assert f"{s['steps_completed']}/{s['steps_requested']}" in text
    assert s["final_state_sha256"] in text
    assert f"({rec['bytes_transferred']} bytes)" in text
    assert f"survivors restarted {rec['survivors_restarted']}" in text
    assert "kill_worker of rank 1 at step 15 (injected)" in text
    assert f"resumed from committed step {rec['target_step']}" in text


def test_recovery_view_matches_summary_and_events(killed_run):
    run = load_run(str(killed_run))
    (v,) = recoveries(run)
    (rec,) = run.summary["recoveries"]
    assert v.replacements == rec["replacements"] and v.failed_ranks == [1]
    phases = v.phases
    assert [p[0] for p in phases] == ["detect", "reconfigure", "transfer", "resume"]
    assert phases[-1][1] + phases[-1][2] == pytest.approx(v.t_resumed)
    # anchored on the events: the fault fired at the drawn failure time, the resume ends the downtime
    fault = run.of("fault_injected")[0]
    assert v.fault is not None and v.fault["time"] == fault["time"]
    assert v.t_fail == fault["time"]  # the summary keeps the coordinator's anchor: the event's own time
    assert v.redone_steps and v.redone_steps[-1] == v.target_step + 1 + v.rolled_back
    # the events alone (what a running job's report uses) give the same phases as the summary
    (e,) = report.recoveries(load_run_without_summary(killed_run))
    for name in ("detect_s", "reconfigure_s", "transfer_s", "resume_s", "downtime_s"):
        assert getattr(e, name) == pytest.approx(rec[name], abs=2e-3), name


def load_run_without_summary(path):
    run = load_run(str(path))
    run.summary = None
    return run


def test_chart_is_drawn_from_the_run(killed_run, tmp_path):
    out = tmp_path / "chart.png"
    buf = io.StringIO()
    assert commands.main(["report", str(killed_run), "--out", str(out)], out=buf) == 0
    w, h = _png_size(out)
    assert w >= 1000 and h >= 700
    assert out.stat().st_size > 30_000  # a drawn chart, not an empty canvas
    assert f"chart: {out}" in buf.getvalue()
    # the default place is the run directory
    assert commands.main(["report", str(killed_run)], out=io.StringIO()) == 0
    assert (killed_run / "report.png").exists()


def test_sweep_table_and_chart(killed_run, tmp_path):
    # a second run dir: the same run, copied (a sweep of one config)
    other = tmp_path / "sweep" / "1"
    shutil.copytree(killed_run, other)
    first = tmp_path / "sweep" / "0"
    shutil.copytree(killed_run, first)
    summary = json.loads((first / "summary.json").read_text())
    buf = io.StringIO()
    assert commands.main(["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "sweep.png")], out=buf) == 0
    text = buf.getvalue()
    header = text.splitlines()[0].split()
    assert header[:3] == ["run", "status", "steps"] and "downtime_s" in header
    rows = [line for line in text.splitlines() if line.split()[:1] and line.split()[0] in ("0", "1")]
    assert len(rows) == 2, text
    rec = summary["recoveries"][0]
    assert f"{rec['downtime_s']:.4f}" in rows[0] and f"{100 * summary['goodput']:.2f}%" in rows[0]
    assert "same final state: 0, 1" in text
    _png_size(tmp_path / "sweep.png")


def test_report_of_a_running_job_uses_events(killed_run, tmp_path):
    partial = tmp_path / "running"
    shutil.copytree(killed_run, partial)
    (partial / "summary.json").unlink()
    lines = (partial / "events.jsonl").read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if '"event":"resumed"' in line) + 5
    (partial / "events.jsonl").write_text("\n".join(lines[:cut]) + "\n" + lines[cut][:20])  # torn last line
    run = load_run(str(partial))
    text = report.run_text(run, now=run.events[-1]["time"])
    assert "no summary.json yet" in text and "recoveries      1" in text


# ------------------------------------------------------------------ pure folding on hand-written events
def _ev(event, t, **kw):
    base = {"event": event, "time": float(t), "gen": kw.pop("gen", -1), "rank": None, "node": None, "step": None}
    base.update(kw)
    return base


def _synthetic():
    return [
        _ev("job_started", 0, job="j", world=4, address="127.0.0.1:1"),
        *[_ev("node_started", 0.1, node=n, role="active", workers=2) for n in ("local0", "local1")],
        _ev("node_started", 0.1, node="local2", role="spare", workers=2),
        *[_ev("worker_ready", 1, worker=f"local{n}.{j}", node=f"local{n}") for n in (0, 1) for j in (0, 1)],
        *[_ev("spare_ready", 1, worker=f"local2.{j}", node="local2") for j in (0, 1)],
        _ev("generation_started", 1.0, gen=0, step=0),
        *[_ev("step", 1 + 0.1 * s, gen=0, step=s, loss=1.0 / s, step_s=0.1) for s in range(1, 6)],
        _ev("fault_injected", 1.55, gen=0, rank=3, kind="kill_worker", step=5),
        _ev("failure_detected", 1.56, gen=0, rank=3, worker="local1.1", node="local1", role="active", reason="exit"),
        _ev("node_excluded", 1.56, node="local1"),
        _ev("failure_detected", 1.56, gen=0, rank=2, worker="local1.0", node="local1", role="active", reason="exit"),
        _ev("generation_bumped", 1.57, gen=1),
        _ev("spare_promoted", 1.58, gen=1, rank=2, worker="local2.0", step=5),
        _ev("spare_promoted", 1.58, gen=1, rank=3, worker="local2.1", step=5),
        _ev("state_transferred", 1.60, gen=1, worker="local2.0", seconds=0.01, bytes=10),
        _ev("reformed", 1.62, gen=1, step=5, replacements={"2": "local2.0", "3": "local2.1"}, bytes=20),
        _ev("resumed", 1.70, gen=1, step=6),
        *[_ev("step", 1.7 + 0.1 * (s - 6), gen=1, step=s, loss=1.0 / s, step_s=0.1) for s in range(6, 9)],
    ]


def test_rank_history_follows_promotions():
    hist = rank_history(_synthetic())
    assert hist[0] == [(0, "local0.0")] and hist[1] == [(0, "local0.1")]
    assert hist[2] == [(0, "local1.0"), (1, "local2.0")]
    assert hist[3] == [(0, "local1.1"), (1, "local2.1")]


def test_recoveries_and_progress_from_events():
    from ckptless_hpc.rundir.read import Run

    events = _synthetic()
    (r,) = recoveries(Run("x", events))
    assert r.failed_ranks == [2, 3] and r.failed_nodes == ["local1"]
    assert r.detect_s == pytest.approx(0.01) and r.transfer_s == pytest.approx(0.01)
    assert r.reconfigure_s == pytest.approx(0.05) and r.resume_s == pytest.approx(0.08)
    assert r.downtime_s == pytest.approx(0.15)
    assert r.fault is not None and r.cause() == "kill_worker of rank 3 at step 5 (injected)"
    assert r.rolled_back == 0 and r.redone_steps == [6]
    p = progress(events, 8, now=2.0)
    assert (p.phase, p.step, p.gen, p.recoveries, p.failures) == ("training", 8, 1, 1, 2)
    assert p.workers_alive == 4 and p.spares_ready == 0
    assert p.last_event_age_s == pytest.approx(0.1)


def test_attempts_split_at_each_coordinator_start():
    first = _synthetic()[:15] + [_ev("job_finished", 2.0, status="requeued", error="time limit")]  # up to step 4
    second = [dict(e, time=e["time"] + 10) for e in _synthetic()]
    events = first + second
    assert [len(a) for a in split_attempts(events)] == [len(first), len(second)]
    (q,) = requeues(events)
    assert q.t_end == 2.0 and q.t_restart == 11.0 and "time limit" in q.reason
    ser = step_series(events)
    assert [len(s.t) for s in ser.segments()] == [4, 8]
    assert ser.t[0] == pytest.approx(0.1)  # time counts from the first attempt's start


def test_torn_last_line_is_skipped_but_a_broken_middle_line_is_an_error():
    assert len(parse_events('{"event":"a","time":1}\n{"event":"b","ti')) == 1
    with pytest.raises(RunDirError, match="line 1"):
        parse_events('{"event":\n{"event":"b","time":1}\n')


def test_throughput_notches_at_a_gap_and_ignores_bursts():
    t = [0.1 * i for i in range(12)] + [2.1 + 0.1 * i for i in range(5)]
    times, fast, slow = report.throughput(t, short=3, long=10)
    assert fast[0] == pytest.approx(10) and fast[10] == pytest.approx(10)
    gap = times.index(2.1)
    assert fast[gap] == pytest.approx(3 / 1.2)  # the 1 s gap pulls the rate down
    burst = report.throughput([0.0, 1.0, 1.0001, 2.0], short=3)[1]
    assert max(burst) < 3.5  # two events 0.1 ms apart are not read as 10000 steps/s
    assert report.robust_top([1.0] * 99 + [1000.0], headroom=1.0) == 1.0


def test_evaluation_panel_and_own_metrics_from_events():
    """The last evaluation of each step is kept (a recovered generation redoes one), the panel
    names the steps and the last values; the own metrics are the last step's."""
    from ckptless_hpc.rundir.read import Run

    events = _synthetic() + [
        _ev("step", 3.0, step=9, loss=0.5, metrics={"accuracy": 0.25}),
        _ev("eval", 3.1, step=4, metrics={"loss": 1.0}, gen=0),
        _ev("eval", 3.2, step=8, metrics={"loss": 0.75}, gen=0),
        _ev("eval", 3.3, step=8, metrics={"loss": 0.75}, gen=1),
        _ev("step", 3.4, step=10, loss=0.5, metrics={"accuracy": 0.5}),
    ]
    lines = report.metric_lines(Run("x", events))
    assert lines == ["  evaluations     2, at step(s) 4, 8; last (step 8): loss 0.7500", "  own metrics     last step: accuracy 0.5000"]
    assert report.metric_lines(Run("x", _synthetic())) == []
