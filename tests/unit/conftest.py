"""Fixtures of the unit tests that need a real filesystem of their own."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs of its own (root only): fills up for real, can be remounted read-only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)
