"""The run record's writers (record.py, rundir/events.py's EventLog) against real filesystems: a tiny
tmpfs that fills up and one remounted read-only. A failed write is reported, never raised, and
loses nothing already written; every JSON written is strict."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess

import pytest

from ckpt_testlib import fill_up
from ckptless_hpc.rundir import record
from ckptless_hpc.rundir.events import EventLog, parse_events
from ckptless_hpc.rundir.record import RecordError, RecordFileHandler
from ckptless_hpc.train.engine import skip_budget

pytestmark = pytest.mark.timeout(60)


def _strict_loads(text: str):
    def refuse(token):
        raise AssertionError(f"not JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def _fill(fs) -> None:
    fill_up(fs)


def test_json_is_strict_and_non_finite_values_read_back_as_floats():
    text = record.dumps({"loss": float("nan"), "r": [float("inf"), -float("inf"), 1.5], "n": {"x": (float("nan"),)}, "ok": 2})
    got = _strict_loads(text)
    assert got == {"loss": "nan", "r": ["inf", "-inf", 1.5], "n": {"x": ["nan"]}, "ok": 2}
    assert [float(v) for v in got["r"]] == [float("inf"), -float("inf"), 1.5]
    assert record.dumps({"a": 1.0}) == json.dumps({"a": 1.0})  # finite data: unchanged


def test_atomic_write_on_a_full_disk_keeps_the_old_file(tiny_fs):
    path = str(tiny_fs / "summary.json")
    record.write_json(path, {"status": "old"})
    _fill(tiny_fs)
    with pytest.raises(RecordError) as e:
        record.atomic_write(path, b"x" * 100_000)
    msg = str(e.value)
    assert msg.startswith(f"cannot write {path}: no space left on the filesystem holding {tiny_fs}. HINT:") and "hydra.run.dir" in msg, msg
    assert e.value.path == path
    assert json.loads(open(path).read()) == {"status": "old"}
    assert sorted(os.listdir(tiny_fs)) == ["filler", "summary.json"]  # no temporary file left


def test_atomic_write_in_a_read_only_dir_names_it(tiny_fs):
    path = str(tiny_fs / "restart.json")
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True, timeout=20)
    with pytest.raises(RecordError, match=f"{tiny_fs} is on a read-only filesystem. HINT"):
        record.write_json(path, {"saved": None})


def test_the_event_log_stops_on_a_full_disk_without_raising(tiny_fs):
    path = str(tiny_fs / "events.jsonl")
    told = []
    ev = EventLog(path, "job", on_error=lambda p, m: told.append((p, m)))
    ev.emit("job_started")
    ev.emit("step", step=1, loss=float("nan"))  # strict: "nan", not NaN
    _fill(tiny_fs)
    for i in range(2, 200):  # ~200 bytes each: the disk is full well before the end
        assert ev.emit("step", step=i, pad="x" * 200)["step"] == i  # the caller always gets its event
    assert len(told) == 1 and told[0][0] == path, told
    assert f"cannot write {path}: no space left" in told[0][1] and "HINT" in told[0][1]
    ev.close()
    events = parse_events(open(path).read())  # a torn last line at most
    assert [e["event"] for e in events[:2]] == ["job_started", "step"] and events[1]["loss"] == "nan"
    for line in open(path).read().splitlines()[:-1]:
        _strict_loads(line)


def test_a_log_file_that_fills_up_is_said_once_and_the_console_goes_on(tiny_fs, capsys):
    logger = logging.getLogger("test_record.full")
    logger.propagate = False
    handler = RecordFileHandler(str(tiny_fs / "coordinator.log"))
    logger.addHandler(handler)
    try:
        logger.warning("before")
        _fill(tiny_fs)
        for i in range(100):
            logger.warning("line %d %s", i, "y" * 4096)
    finally:
        logger.removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert err.count("cannot write") == 1 and "no space left" in err and "Logging error" not in err and "Traceback" not in err, err
    assert "before" in open(tiny_fs / "coordinator.log").read()


def test_failures_are_said_once_per_path(caplog):
    f = record.Failures()
    with caplog.at_level(logging.ERROR, logger="ckptless_hpc.rundir.record"):
        f.report("/r/events.jsonl", "cannot write /r/events.jsonl: full")
        f.report("/r/events.jsonl", "cannot write /r/events.jsonl: full again")
        f.report("/r/summary.json", "cannot write /r/summary.json: full")
    assert f.messages == ["cannot write /r/events.jsonl: full", "cannot write /r/summary.json: full"]
    assert len(caplog.records) == 2


def test_a_fresh_run_dir_is_made_private_an_used_one_is_left_alone(tmp_path):
    fresh, used = tmp_path / "fresh", tmp_path / "used"
    for d in (fresh, used):
        (d / ".hydra").mkdir(parents=True)
        os.chmod(d, 0o755)
    (used / "events.jsonl").write_text("")
    record.make_private(str(fresh))
    record.make_private(str(used))
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(used).st_mode) == 0o755


@pytest.mark.parametrize("steps, fraction, allowed", [(60, 0.1, 6), (60, 1.0, 60), (60, 0.0, 0), (100, 0.29, 29), (7, 0.5, 3)])
def test_the_skip_budget(steps, fraction, allowed):
    assert skip_budget(steps, fraction) == allowed


def test_degraded_spans_open_at_a_shrink_and_close_when_whole_again():
    from ckptless_hpc.metrics import Degraded

    d = Degraded()
    d.reformed(5, 100.0, 3, 3)  # a recovery with a spare: never degraded
    assert not d.spans and d.report(200.0, 40) == {"seconds": 0, "spans": []}
    d.reformed(10, 110.0, 2, 3)
    d.reformed(14, 112.0, 1, 3)  # a second loss while shrunk: the same span, fewer processes
    d.reformed(20, 115.5, 3, 3)
    d.reformed(30, 120.0, 2, 3)  # shrunk again and never grown back: open until the end
    assert d.report(125.0, 40) == {
        "seconds": 10.5,
        "spans": [{"from_step": 10, "to_step": 20, "processes": 1, "seconds": 5.5}, {"from_step": 30, "to_step": 40, "processes": 2, "seconds": 5.0}],
    }
