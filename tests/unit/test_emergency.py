"""The emergency copy (state/emergency.py) against real files and real filesystems: a tiny
tmpfs that fills up, one remounted read-only, files truncated and altered on disk."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import torch

from ckptless_hpc.state import emergency
from ckptless_hpc.state.emergency import EmergencyCopyError
from ckptless_hpc.state.snapshot import state_sha256

pytestmark = pytest.mark.timeout(60)


def _state(step: int, n: int = 1000):
    g = torch.Generator().manual_seed(step)
    return [("model.w", torch.randn(n, generator=g)), ("optim.0.exp_avg", torch.randn(n, generator=g))], {"step": step, "param_groups": []}


def _file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_write_then_read_round_trip(tmp_path):
    entries, meta = _state(7)
    path = str(tmp_path / "state" / "emergency.pt")
    rec = emergency.write(path, entries, meta)
    assert rec == {"path": path, "step": 7, "sha256": state_sha256(entries, meta), "bytes": os.path.getsize(path), "written": True}
    got, got_meta = emergency.read(path, rec["sha256"])
    assert got_meta == meta and [n for n, _ in got] == [n for n, _ in entries]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, entries))
    plain = torch.load(path, weights_only=True)  # an ordinary torch file, as the docs show
    assert plain["meta"]["step"] == 7 and set(plain["entries"]) == {"model.w", "optim.0.exp_avg"}
    assert os.listdir(tmp_path / "state") == ["emergency.pt"]  # no temporary file left behind
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # the user's model: the user's only


def test_a_copy_never_replaces_a_newer_one(tmp_path):
    path = str(tmp_path / "emergency.pt")
    newer = emergency.write(path, *_state(300))
    before = _file_bytes(path)
    kept = emergency.write(path, *_state(0))  # e.g. a freshly built model of step 0
    assert kept == {**newer, "written": False}
    assert _file_bytes(path) == before
    assert emergency.write(path, *_state(301))["written"] is True  # a later step does replace it


def test_a_damaged_copy_protects_nothing_and_is_replaced(tmp_path):
    path = str(tmp_path / "emergency.pt")
    emergency.write(path, *_state(300))
    os.truncate(path, os.path.getsize(path) // 2)
    rec = emergency.write(path, *_state(5))
    assert rec["written"] and rec["step"] == 5
    assert emergency.read(path, rec["sha256"])[1]["step"] == 5


def test_read_refuses_a_truncated_copy(tmp_path):
    path = str(tmp_path / "emergency.pt")
    rec = emergency.write(path, *_state(9))
    os.truncate(path, rec["bytes"] - 100)
    with pytest.raises(EmergencyCopyError, match="damaged or truncated") as e:
        emergency.read(path, rec["sha256"])
    assert path in str(e.value) and "HINT" in str(e.value)


def test_read_refuses_an_altered_copy(tmp_path):
    path = str(tmp_path / "emergency.pt")
    entries, meta = _state(9)
    rec = emergency.write(path, entries, meta)
    data = bytearray(_file_bytes(path))
    needle = entries[0][1][:4].numpy().tobytes()  # a few bytes of a tensor, in place in the zip
    at = data.find(needle)
    assert at > 0
    data[at] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(EmergencyCopyError, match="damaged") as e:
        emergency.read(path, rec["sha256"])
    assert path in str(e.value)


def test_read_refuses_a_copy_that_is_not_the_one_recorded(tmp_path):
    path = str(tmp_path / "emergency.pt")
    emergency.write(path, *_state(9))
    with pytest.raises(EmergencyCopyError, match="does not match the sha256 recorded"):
        emergency.read(path, "0" * 64)
    with pytest.raises(EmergencyCopyError, match="is missing"):
        emergency.read(str(tmp_path / "none.pt"), "0" * 64)


def test_full_disk_keeps_the_previous_copy(tiny_fs):
    path = str(tiny_fs / "state" / "emergency.pt")
    small = emergency.write(path, *_state(3, n=100))
    before = _file_bytes(path)
    with pytest.raises(EmergencyCopyError) as e:
        emergency.write(path, *_state(4, n=100_000))  # 800 KB on a 256 KiB filesystem: ENOSPC
    msg = str(e.value)
    assert path in msg and "no space left" in msg and "HINT" in msg and "previous copy (step 3)" in msg
    assert _file_bytes(path) == before and os.listdir(tiny_fs / "state") == ["emergency.pt"]
    assert emergency.read(path, small["sha256"])[1]["step"] == 3


def test_read_only_run_dir_is_named_and_keeps_the_previous_copy(tiny_fs):
    path = str(tiny_fs / "state" / "emergency.pt")
    small = emergency.write(path, *_state(3, n=100))
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True, timeout=20)
    with pytest.raises(EmergencyCopyError) as e:
        emergency.write(path, *_state(4, n=100))
    msg = str(e.value)
    assert path in msg and "read-only" in msg and "HINT" in msg and "untouched" in msg
    assert emergency.read(path, small["sha256"])[1]["step"] == 3
