"""rundir/events.py: the event log's writer and reader from one field list (HEADER). The bytes
written are pinned: tools and users parse events.jsonl of jobs run by older versions too."""

from __future__ import annotations

import pytest

from ckptless_hpc.rundir.events import ATTEMPT_START, HEADER, EventLog, RunDirError, parse_events, read_events, split_attempts
from ckptless_hpc.rundir.paths import RunPaths

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_an_event_line_is_the_header_then_its_fields(tmp_path):
    log = EventLog.in_run_dir(str(tmp_path), "j1", Clock(100.0, 101.25))
    rec = log.emit(ATTEMPT_START, gen=0, world=2, loss=float("nan"))
    log.emit("step", at=102.5, rank=0, node="n1", step=3)
    log.close()
    assert log.path == RunPaths(str(tmp_path)).events
    assert (tmp_path / "events.jsonl").read_text() == (
        '{"event":"job_started","time":101.25,"t":1.25,"job":"j1","gen":0,"rank":null,"node":null,"step":null,"world":2,"loss":"nan"}\n'
        '{"event":"step","time":102.5,"t":2.5,"job":"j1","gen":null,"rank":0,"node":"n1","step":3}\n'
    )
    assert list(rec)[: len(HEADER)] == list(HEADER)


def test_the_reader_gives_back_what_the_writer_wrote_attempt_by_attempt(tmp_path):
    written = []
    for attempt in range(2):  # a requeued job appends its second attempt to the same file
        log = EventLog.in_run_dir(str(tmp_path), "j1", Clock(10.0 * attempt))
        written += [log.emit(ATTEMPT_START, at=10.0 * attempt + 1), log.emit("step", at=10.0 * attempt + 2, step=1)]
        log.close()
    events = read_events(str(tmp_path))
    assert [{k: e[k] for k in HEADER} for e in events] == [{k: w[k] for k in HEADER} for w in written]
    assert [[e["t"] for e in att] for att in split_attempts(events)] == [[1.0, 2.0], [1.0, 2.0]]


def test_a_torn_last_line_is_skipped_a_torn_middle_line_is_an_error():
    assert parse_events('{"event":"a"}\n{"event":"b"') == [{"event": "a"}]
    with pytest.raises(RunDirError, match=r"events.jsonl line 1 is not JSON: .*HINT: the file was edited or truncated"):
        parse_events('{"event":\n{"event":"b"}\n')


def test_no_file_yet_reads_as_no_events(tmp_path):
    assert read_events(str(tmp_path / "not-yet")) == []
    assert split_attempts([]) == [] and split_attempts([{"event": "step"}]) == [[{"event": "step"}]]


def test_the_readers_names_answer_from_read_too():
    """tools/ and the tests read a run through rundir/read.py: its event names are events.py's."""
    from ckptless_hpc.rundir import read

    assert read.parse_events is parse_events and read.split_attempts is split_attempts and read.RunDirError is RunDirError


def test_the_readers_number_ranks_by_the_coordinators_rule():
    """rundir/numbering.py is the coordinator's rule, moved below it: both give the same answers."""
    from ckptless_hpc.coordinator import planner
    from ckptless_hpc.rundir import numbering

    nodes = [("n10", ["n10.0", "n10.1"]), ("n2", ["n2.0", "n2.1"])]
    assert numbering.initial_ranks(nodes) == planner.initial_ranks(nodes) == {0: "n10.0", 1: "n10.1", 2: "n2.0", 3: "n2.1"}
    names = ["n10", "n2", "x", "local1", "n1a"]
    assert sorted(names, key=numbering.node_order) == sorted(names, key=planner.node_order) == ["local1", "n2", "n10", "n1a", "x"]
