from __future__ import annotations

import logging

import pytest

from ckptless_hpc.progress import Progress, Snapshot

pytestmark = pytest.mark.timeout(10)


def snap(step: int) -> Snapshot:
    return Snapshot(step=step, total=30, loss=2.5, samples_per_s=400.0, steps_per_s=25.0, alive=2, world=2, spares=1, recoveries=1, goodput=0.95, gen=1)


def test_plain_lines_every_log_every_steps(caplog):
    p = Progress(total=30, log_every=10, tty=False)
    with caplog.at_level(logging.INFO, logger="ckptless_hpc.progress"):
        for s in range(1, 31):
            p.update(snap(s))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and lines[0].startswith("step 10/30 loss 2.5000 | 400 samples/s | workers 2/2 spares 1 | recoveries 1 | goodput 95.0%")


def test_terminal_bar(capsys):
    p = Progress(total=30, log_every=10, tty=True)
    for s in range(1, 31):
        p.update(snap(s))
    p.close()
    err = capsys.readouterr().err
    assert "30/30" in err and "recoveries 1" in err


def test_log_tail_returns_complete_new_lines_and_follows_a_moved_rank(tmp_path):
    from ckptless_hpc.progress import LogTail

    a, b = tmp_path / "n1.0.log", tmp_path / "n3.0.log"
    tail = LogTail()
    assert tail.read(str(a)) == []  # not written yet
    a.write_text("one\ntw")
    assert tail.read(str(a)) == ["one"]  # a half-written line waits for its end
    with a.open("a") as f:
        f.write("o\nthree\n")
    assert tail.read(str(a)) == ["two", "three"]
    assert tail.read(str(a)) == []
    with a.open("a") as f:
        f.write("last words\n")
    b.write_text("spare built\nrank 0 now\n")  # the rank moved: the old file's last lines, then the new from its top
    assert tail.read(str(b)) == ["last words", "spare built", "rank 0 now"]
    assert tail.read(None) == []


def test_echo_prints_plain_lines_or_above_the_bar(capsys):
    plain = Progress(total=3, log_every=1, tty=False)
    plain.echo(["gen=0 rank=0 hello"])
    assert capsys.readouterr().out == "gen=0 rank=0 hello\n"
    bar = Progress(total=3, log_every=1, tty=True)
    bar.update(snap(1))
    bar.echo(["gen=0 rank=0 above"])
    bar.close()
    out = capsys.readouterr()
    assert "gen=0 rank=0 above\n" in out.out and "1/3" in out.err


def test_a_job_with_fewer_processes_than_ranks_says_degraded():
    whole, shrunk = snap(10), snap(10)
    shrunk.alive, shrunk.world = 2, 3
    assert "workers 2/2 spares" in whole.line() and "workers 2/3 (degraded) spares" in shrunk.line()
