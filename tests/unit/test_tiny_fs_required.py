"""``CKPTLESS_REQUIRE_MOUNT=1`` makes a tmpfs that cannot be mounted fail the tests that need it.

The full-disk and read-only run-dir tests (test_emergency.py, test_record.py) prove their claims
only on a real filesystem of their own (``tiny_fs``, tests/unit/conftest.py). Where ``mount``
fails they skip; CI runs as root, where tests/run.sh sets ``CKPTLESS_REQUIRE_MOUNT=1`` and a skip
there must be a failure. Here a real pytest runs a test that uses the real fixture, with a
``mount`` on ``PATH`` that fails as a container without CAP_SYS_ADMIN does: skipped without the
variable; with it, an error of the test (the fixture fails) naming the reason, with a HINT.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

CONFTEST = Path(__file__).with_name("conftest.py")


def _inner(tmp_path: Path, require: bool) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mount").write_text("#!/bin/sh\necho 'mount: /x: permission denied.' >&2\nexit 32\n")
    (fake / "mount").chmod(0o755)
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('unit_conftest', {str(CONFTEST)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\ntiny_fs = mod.tiny_fs\n"
    )
    (tmp_path / "test_needs_fs.py").write_text("def test_needs_fs(tiny_fs):\n    assert tiny_fs.is_dir()\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "CKPTLESS_REQUIRE_MOUNT"}
    env["PATH"] = f"{fake}{os.pathsep}{env.get('PATH', '')}"
    if require:
        env["CKPTLESS_REQUIRE_MOUNT"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rsf",
        "-p",
        "no:cacheprovider",
        "-c",
        str(tmp_path / "pytest.ini"),
        "--rootdir",
        str(tmp_path),
        str(tmp_path / "test_needs_fs.py"),
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)


def test_a_failed_mount_skips_without_the_requirement(tmp_path):
    p = _inner(tmp_path, require=False)
    assert p.returncode == 0 and "1 skipped" in p.stdout, p.stdout + p.stderr
    reason = "permission denied" if os.geteuid() == 0 else "needs root"
    assert reason in p.stdout, p.stdout


def test_a_failed_mount_fails_with_its_reason_where_it_is_required(tmp_path):
    p = _inner(tmp_path, require=True)
    assert p.returncode == 1 and "1 error" in p.stdout and "skipped" not in p.stdout, p.stdout + p.stderr  # a fixture's failure: an error of the test
    reason = "cannot mount a tmpfs here: mount: /x: permission denied." if os.geteuid() == 0 else "mounting a tmpfs needs root"
    assert reason in p.stdout and "CKPTLESS_REQUIRE_MOUNT=1 requires the tmpfs" in p.stdout and "HINT:" in p.stdout, p.stdout
