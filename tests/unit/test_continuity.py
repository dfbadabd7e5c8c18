"""Survivor continuity from outside the control connection: the pure comparison, and real
processes started, killed and started again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptless_hpc.coordinator.continuity import compare, parse_start_ticks, proc_identity

pytestmark = pytest.mark.timeout(30)


def test_start_ticks_are_read_past_a_command_name_with_spaces_and_parentheses():
    stat = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 1 0 0 20 0 1 0 987654 1000 10"
    assert parse_start_ticks(stat) == 987654


def test_the_same_process_is_no_restart():
    assert compare({"a.0": (10, 500)}, {"a.0": (10, 500)}) == ({}, [])


def test_a_relaunched_a_reused_pid_and_a_gone_process_are_restarts():
    launched = {"a.0": (10, 500), "b.0": (11, 500), "c.0": (12, 500), "d.0": (13, 500, 7)}
    now = {"a.0": (99, 900), "b.0": (11, 901), "c.0": None, "d.0": (13, 500, 8)}  # new pid; pid reused; gone; new Slurm step
    restarted, unmeasured = compare(launched, now)
    assert sorted(restarted) == ["a.0", "b.0", "c.0", "d.0"] and unmeasured == []
    assert "is gone" in restarted["c.0"] and "(11, 901)" in restarted["b.0"]


def test_no_identity_at_launch_is_unmeasured_not_a_restart():
    assert compare({"a.0": None}, {"a.0": (10, 500)}) == ({}, ["a.0"])


def test_real_processes_killed_and_started_again_are_caught():
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        launched = {"w": proc_identity(first.pid)}
        assert launched["w"][0] == first.pid
        assert compare(launched, {"w": proc_identity(first.pid)}) == ({}, [])  # alive, untouched
        first.kill()
        first.wait()
        assert proc_identity(first.pid) is None
        second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            restarted, _ = compare(launched, {"w": proc_identity(second.pid)})
            assert "w" in restarted
        finally:
            second.kill()
            second.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_own_identity_is_stable():
    assert proc_identity(os.getpid()) == proc_identity(os.getpid())
