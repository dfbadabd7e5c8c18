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
