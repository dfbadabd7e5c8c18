"""rundir/summary.py: summary.json's shape (FIELDS) is the one the coordinator writes, key for
key and in order; its reader and writer."""

from __future__ import annotations

import json

import pytest

from ckptless_hpc.coordinator.shell import Coordinator
from ckptless_hpc.rundir import summary
from ckptless_hpc.rundir.events import RunDirError
from coordlib import NoLauncher, cfg

pytestmark = pytest.mark.timeout(60)


def test_the_coordinators_summary_has_exactly_the_declared_fields_in_order(tmp_path):
    c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2"), str(tmp_path), NoLauncher(), "s" * 64, "job-test")
    try:
        assert c._finish(0, "completed", None) == 0
    finally:
        c.record.events.close()
    written = json.loads((tmp_path / "summary.json").read_text())
    assert list(written) == list(summary.FIELDS), "a key was added to (or dropped from) summary.json: declare it in rundir/summary.py FIELDS"
    assert summary.read(str(tmp_path)) == written and written["status"] == "completed"


def test_write_then_read(tmp_path):
    path = summary.write(str(tmp_path), {"status": "failed", "loss": float("inf")})
    assert path == str(tmp_path / "summary.json") and json.loads((tmp_path / "summary.json").read_text()) == {"status": "failed", "loss": "inf"}
    assert summary.read(str(tmp_path)) == {"status": "failed", "loss": "inf"}


def test_no_summary_yet_is_none_a_broken_one_an_error_with_a_hint(tmp_path):
    assert summary.read(str(tmp_path)) is None
    (tmp_path / "summary.json").write_text('{"status": ')
    with pytest.raises(RunDirError, match=r"summary.json' is not valid JSON .*HINT: was it written by ckptless_hpc"):
        summary.read(str(tmp_path))
