"""Fixtures of the unit tests that need a real filesystem of their own.

``tiny_fs`` mounts a tmpfs, which needs root and a kernel that lets this process mount. Where it
cannot, the tests that use it skip with the reason; with ``CKPTLESS_REQUIRE_MOUNT=1`` (set by
tests/run.sh when it runs as root, as CI does) they fail with the reason instead: there the
full-disk and read-only run-dir tests are the proof of those claims, and a skip would pass
without proving anything.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

REQUIRE_ENV = "CKPTLESS_REQUIRE_MOUNT"


def cannot_mount(reason: str) -> None:
    """Skip, or fail where ``CKPTLESS_REQUIRE_MOUNT=1`` says the capability must be there."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(
            f"{reason}, and {REQUIRE_ENV}=1 requires the tmpfs (tests/run.sh sets it when run as root). "
            f"HINT: run where root may mount a tmpfs (a container needs CAP_SYS_ADMIN), or unset {REQUIRE_ENV} to let these tests skip",
            pytrace=False,
        )
    pytest.skip(reason)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs of its own (root only): fills up for real, can be remounted read-only."""
    if os.geteuid() != 0:
        cannot_mount("mounting a tmpfs needs root")
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        cannot_mount(f"cannot mount a tmpfs here: {r.stderr.strip() or f'mount exited {r.returncode}'}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)
