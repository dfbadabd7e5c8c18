"""A run directory that stops taking writes while the job trains: a real full filesystem (a
tmpfs of its own as the run dir, filled up), a run dir turned read-only (a read-only bind mount
over it), and a cancel on a full disk. The job still ends, with its own exit code; the result
(status, steps, final hash) reaches the console; each failed file is named once with the fix (the trained model that could not be written is a
clear failure: exit 1, final_save_failed);
what was written before stays readable (no torn file but the event log's last line)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_testlib import REPO, fill_up, wait_for
from ckptless_hpc.rundir.read import parse_events

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

CFG = ("task=mlp", "train.steps=400", "train.log_every=50")
SHA = re.compile(r"state sha256 ([0-9a-f]{64})")


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({' '.join(args)}): {r.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20)


@pytest.fixture
def own_fs(tmp_path):
    """A 16 MiB tmpfs of its own, the run dir (root only: CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    run = tmp_path / "run"
    run.mkdir()
    _mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(run))
    try:
        yield run
    finally:
        _umount(run)


def _fill(fs: Path) -> None:
    """Write until the filesystem says ENOSPC: it is full for everyone after this."""
    e = fill_up(fs, 65536)
    assert e.errno == 28, e  # ENOSPC, nothing else

class Job:
    """A job started in the background, its console in a file outside the run dir."""

    def __init__(self, tmp_path: Path, run_dir: Path, *overrides: str) -> None:
        self.run_dir = run_dir
        self.console = tmp_path / "console.txt"
        with open(self.console, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", *overrides], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def step_reached(self, step: int) -> None:
        def seen():
            assert self.proc.poll() is None, f"the job ended (rc {self.proc.returncode}) before step {step}:\n{self.out}"
            path = self.run_dir / "events.jsonl"
            return path.exists() and any(e.get("event") == "step" and e["step"] >= step for e in parse_events(path.read_text()))

        wait_for(f"step {step} of the job", seen, 240, poll_s=0.05)

    def end(self, timeout_s: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)  # a wedged coordinator fails here (it used to stay up for ten minutes)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    @property
    def out(self) -> str:
        return self.console.read_text()


def _intact(run_dir: Path) -> list:
    """What the job wrote before the disk failed is readable: the events (a torn last line is
    skipped by readers, nothing else may be torn), restart.json whole; no temporary file left."""
    events = parse_events((run_dir / "events.jsonl").read_text())
    assert events[0]["event"] == "job_started" and any(e["event"] == "step" for e in events)
    import json

    assert json.loads((run_dir / "restart.json").read_text())["excluded_nodes"] == []
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name], "a temporary file was left behind"
    return events


def test_a_full_disk_near_the_end_neither_wedges_the_job_nor_hides_its_result(tmp_path, own_fs, baseline):
    job = Job(tmp_path, own_fs, *CFG)
    job.step_reached(20)
    _fill(own_fs)
    rc = job.end()
    out = job.out
    assert rc == 1, out  # it trained every step, but the trained model could not be written: a clear failure
    assert "final_save_failed (exit 1)" in out and "steps        400/400" in out, out
    final = next(line for line in out.splitlines() if "the final state was not written" in line)
    assert f"{own_fs / 'final'}" in final and "no space left" in final and "HINT" in final, final  # the trained model's own error
    assert SHA.search(out) and SHA.search(out).group(1) == baseline(*CFG), out  # the real result, on the console
    summary = own_fs / "summary.json"
    assert not summary.exists()  # it could not be written, and no half of it is there
    assert f"cannot write {summary}: no space left on the filesystem holding {own_fs}" in out, out
    assert f"cannot write {own_fs / 'events.jsonl'}: no space left" in out and "hydra.run.dir" in out and "HINT" in out, out
    assert out.count(f"cannot write {own_fs / 'events.jsonl'}") <= 2, "said once (log line + the summary's NOT RECORDED)"
    assert "Traceback" not in out and "Logging error" not in out, out
    events = _intact(own_fs)
    assert not any(e["event"] == "job_finished" for e in events)  # the disk was full before the end: the test tested it


def test_a_read_only_run_dir_at_the_end_still_prints_the_result(tmp_path, baseline):
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    run = tmp_path / "run"
    job = Job(tmp_path, run, *CFG)
    job.step_reached(20)
    _mount("--bind", str(run), str(run))  # files already open keep being written; a new file is refused (EROFS)
    try:
        _mount("-o", "remount,bind,ro", str(run))
        rc = job.end()
        out = job.out
        assert rc == 1 and "final_save_failed (exit 1)" in out, out  # the trained model could not be written
        assert SHA.search(out) and SHA.search(out).group(1) == baseline(*CFG), out
        assert f"{run / 'final'}" in out and "read-only" in out, out
        assert f"cannot write {run / 'summary.json'}: {run} is on a read-only filesystem. HINT" in out and "hydra.run.dir" in out, out
        assert not (run / "summary.json").exists()
        assert "Traceback" not in out, out
        events = _intact(run)
        (end,) = [e for e in events if e["event"] == "job_finished"]  # through the file it had open
        assert end["status"] == "final_save_failed" and end["exit_code"] == 1
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
        _umount(run)


def test_a_cancel_on_a_full_disk_ends_the_job_as_documented(tmp_path, own_fs):
    job = Job(tmp_path, own_fs, "task=mlp", "train.steps=100000", "train.log_every=50")
    job.step_reached(20)
    _fill(own_fs)
    job.proc.send_signal(signal.SIGTERM)
    rc = job.end()
    out = job.out
    assert rc == 6, out  # cancelled, as docs/failure-semantics.md says; not 1 with a traceback
    assert "cancelled (exit 6)" in out and "error        cancelled by SIGTERM" in out, out
    assert f"NOT RECORDED cannot write {own_fs / 'summary.json'}: no space left" in out, out
    assert "Traceback" not in out, out
    _intact(own_fs)
