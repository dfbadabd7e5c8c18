"""The copies of train.save_every / save_every_s: who writes a piece, when a copy is complete
(its index written), which copies are kept, and the timed schedule (moving ``now``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ckptless_hpc.coordinator.saved_copies import SavedCopies
from ckptless_hpc.worker.periodic import PeriodicCopies, writes

pytestmark = pytest.mark.timeout(30)


def test_the_lowest_rank_holding_each_piece_writes_it():
    assert [r for r in range(4) if writes("ddp", r, None)] == [0]
    assert [r for r in range(4) if writes("zero", r, None)] == [0, 1, 2, 3]
    assert [r for r in range(4) if writes("fsdp", r, None)] == [0, 1, 2, 3]
    assert [r for r in range(4) if writes("hsdp", r, 2)] == [0, 1]  # shard r % 2: ranks 0 and 1 hold shards 0 and 1 first


def _piece(root, step, shard):
    folder = root / "saved" / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"shard{shard}.pt"
    path.write_bytes(b"x")
    return SimpleNamespace(path=str(path), step=step, shard=shard, state_sha256=f"s{step}.{shard}", sha256="f", bytes=1)


def test_a_copy_is_indexed_once_complete_and_only_the_newest_are_kept(tmp_path):
    c = SavedCopies(str(tmp_path), shards=2, keep=2, mode="zero")
    for step in (4, 8):
        assert c.add(_piece(tmp_path, step, 0)) is None  # half a copy: not a copy
        rec = c.add(_piece(tmp_path, step, 1))
        assert rec["step"] == step and set(rec["shards"]) == {"0", "1"}
    _piece(tmp_path, 12, 1)  # a piece of 12 whose other half never came
    assert c.add(_piece(tmp_path, 16, 0)) is None
    rec = c.add(_piece(tmp_path, 16, 1))
    index = json.loads((tmp_path / "saved" / "step16" / "index.json").read_text())
    assert index["step"] == 16 and index["files"]["1"]["state_sha256"] == "s16.1"
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["step16", "step8"]  # 4 and the incomplete 12 are gone
    assert c.newest == rec


def test_timed_copies_name_a_step_ahead_every_interval():
    c = SavedCopies("/nonexistent", shards=1, keep=1, mode="ddp")
    assert c.timed(100.0, 5, every_s=0) is None  # off
    assert c.timed(100.0, 5, every_s=10) is None  # the clock starts
    assert c.timed(109.9, 40, every_s=10) is None
    assert c.timed(110.0, 41, every_s=10) == 43
    assert c.timed(115.0, 60, every_s=10) is None
    assert c.timed(120.5, 80, every_s=10) == 82


def test_a_worker_copies_the_steps_it_is_due_or_asked_for(tmp_path):
    cfg = SimpleNamespace(train=SimpleNamespace(save_every=0, steps=100), parallel=SimpleNamespace(mode="ddp", shard_size=None))
    sent = []
    p = PeriodicCopies(cfg, str(tmp_path), sent.append)
    p.ask(7)
    assert not p.due(6) and p.due(7)
    collected = []
    p.after_commit(6, 0, [0], lambda s: collected.append(s) or ([], {"step": s}))
    p.after_commit(7, 1, [0], lambda s: collected.append(s) or ([], {"step": s}))  # rank 1 of ddp writes nothing
    assert collected == []
    p.ask(9)
    p.after_commit(9, 0, [0], lambda s: collected.append(s) or ([], {"step": s}))
    p._writing.join(30)
    assert collected == [9] and sent and sent[-1].encode()["type"] in ("periodic_saved", "periodic_failed")
    assert not p.due(7)  # steps already passed are forgotten
