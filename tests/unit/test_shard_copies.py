"""Shard copies over real sockets: pushed to a holder's state server, verified, kept, served
back; the store's retention (the two newest copies, the durable step's snapshot); config
validation of parallel.* and replication.*."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from omegaconf import OmegaConf

from ckptless_hpc.config import Config, validation_errors
from ckptless_hpc.launch.probes import PROBES
from ckptless_hpc.state.shards import Replicator, ShardStore
from ckptless_hpc.state.snapshot import state_sha256
from ckptless_hpc.state.transfer import StaleState, StateServer, fetch_state

pytestmark = pytest.mark.timeout(60)
SECRET = "s" * 32


def _state(step: int, n: int = 1000):
    g = torch.Generator().manual_seed(step)
    return [("model.w", torch.randn(n, generator=g)), ("optim.0.exp_avg", torch.randn(n, generator=g))], {"step": step, "param_groups": []}


def _holder():
    store = ShardStore()

    def provide(gen, step, shard=None, part="all"):
        copy = store.get(shard, step)
        if copy is None:
            raise StaleState(f"no copy of shard {shard} at {step}")
        return copy

    server = StateServer("127.0.0.1", SECRET, provide, receiver=lambda gen, shard, step, got: store.keep(shard, step, got), landing=store.landing)
    return store, server


def test_a_pushed_copy_is_verified_kept_and_served_back():
    store, server = _holder()
    woke = threading.Event()
    rep = Replicator(SECRET, 10, on_error=lambda e: None, on_change=woke.set)
    own = ShardStore()
    for step in (5, 6, 7):
        copy = own.snapshot(step, *_state(step))
        rep.send(0, 3, step, copy, [("127.0.0.1", server.port, "holder")])
        deadline = time.monotonic() + 10
        while not rep.is_confirmed(step):
            assert time.monotonic() < deadline, "copy never acknowledged"
            woke.wait(0.5)
            woke.clear()
        assert rep.acked(step) == {(3, "holder")}
    assert sorted(store.held[3]) == [6, 7]  # the two newest are kept
    got = fetch_state("127.0.0.1", server.port, SECRET, gen=0, step=7, timeout_s=10, shard=3)
    assert state_sha256(got.entries, got.meta) == state_sha256(*_state(7))
    rep.close()
    server.close()


def test_a_holder_that_is_gone_is_retried_until_it_answers_or_the_copy_is_superseded():
    errors = []
    retried = threading.Event()

    def on_error(e):
        errors.append(e)
        if len(errors) >= 2:  # a second attempt: it is retried
            retried.set()

    rep = Replicator(SECRET, 2, on_error=on_error)
    rep.RETRY_S = 0.05
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead_port = s.getsockname()[1]
    s.close()  # nobody listens there
    own = ShardStore()
    rep.send(0, 1, 4, own.snapshot(4, *_state(4)), [("127.0.0.1", dead_port, "gone")])
    assert retried.wait(20), errors
    assert not rep.is_confirmed(4) and errors and "gone" in errors[0]
    rep.send(1, 1, 4, own.get(0, 4), [])  # a new generation with no holders: confirmed at once
    assert rep.is_confirmed(4)
    rep.close()


def test_every_dtype_a_model_holds_is_copied_bitwise():
    """Failure 2 of issue 30: a complex64 RoPE cache was refused ("unsupported dtype"), the copy
    retried five times a second, forever. Complex, bool, integer, bf16 and fp8 go as bytes."""
    store, server = _holder()
    woke = threading.Event()
    rep = Replicator(SECRET, 10, on_error=lambda e: None, on_change=woke.set)
    entries = [
        ("buffer/freqs_cis", torch.polar(torch.ones(4, 3), torch.rand(4, 3))),
        ("buffer/mask", torch.tensor([True, False, True])),
        ("buffer/count", torch.tensor(7, dtype=torch.int64)),
        ("param/w", torch.randn(5, dtype=torch.bfloat16)),
        ("param/w8", torch.randn(5).to(torch.float8_e4m3fn)),
    ]
    rep.send(0, 2, 1, ShardStore().snapshot(1, entries, {"step": 1}), [("127.0.0.1", server.port, "holder")])
    deadline = time.monotonic() + 10
    while not rep.is_confirmed(1):
        assert time.monotonic() < deadline and rep.refused is None, rep.refused
        woke.wait(0.5)
        woke.clear()
    got = dict(store.get(2, 1)[0])
    assert all(got[n].dtype == t.dtype and torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for n, t in entries)
    rep.close()
    server.close()


def test_a_copy_that_can_never_be_taken_is_not_retried_and_names_the_tensor(monkeypatch):
    """A dtype the wire cannot carry is no transient error: the replicator stops and says which
    tensor and dtype (the worker ends the job with it, worker/steps.py), instead of retrying forever."""
    from ckptless_hpc.state import transfer

    store, server = _holder()
    errors = []
    rep = Replicator(SECRET, 10, on_error=errors.append)
    monkeypatch.delitem(transfer._DTYPES, "torch.complex64")
    rep.send(0, 1, 3, ShardStore().snapshot(3, [("buffer/freqs_cis", torch.zeros(2, dtype=torch.complex64))], {"step": 3}), [("127.0.0.1", server.port, "holder")])
    deadline = time.monotonic() + 10
    while rep.refused is None:
        assert time.monotonic() < deadline, errors
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(errors) == 1 and "buffer/freqs_cis" in rep.refused and "complex64" in rep.refused and not rep.is_confirmed(3)
    rep.close()
    server.close()


def test_snapshots_are_copies_and_the_durable_step_keeps_what_a_rollback_needs():
    st = ShardStore()
    live, meta = _state(1)
    st.snapshot(1, live, meta)
    live[0][1].add_(1.0)  # the live state moves on: the snapshot must not
    assert torch.equal(st.get(0, 1)[0][0][1], _state(1)[0][0][1])
    st.snapshot(2, *_state(2))
    st.snapshot(3, *_state(3))
    st.durable(2)
    assert sorted(st.own[0]) == [2, 3]
    assert st.inventory([0], live=3) == {0: [2, 3]}
    st.durable(5)  # the newest snapshot is always kept
    assert sorted(st.own[0]) == [3]


def test_each_shard_a_worker_steps_has_its_snapshots_and_one_handed_back_is_served_until_dropped():
    st = ShardStore()  # ZeRO in a job that shrank: its rank's shard 0 and lost rank 1's
    for step in (4, 5):
        st.snapshot(step, *_state(step), shard=0)
        st.snapshot(step, *_state(step + 10), shard=1)
    st.durable(5)
    assert st.inventory([0, 1], live=5) == {0: [5], 1: [5]}
    assert state_sha256(*st.get(1, 5)) == state_sha256(*_state(15)) != state_sha256(*st.get(0, 5))
    st.release(1)  # a spare grew the job back and takes rank 1: served from here until the new placement is durable
    assert st.inventory([0], live=6) == {0: [5, 6], 1: [5]} and 1 not in st.own
    st.drop_held({0})
    assert st.inventory([0], live=6) == {0: [5, 6]}


def _cfg(**over):
    cfg = OmegaConf.structured(Config)
    cfg.task = {"_target_": "x"}
    cfg.cluster = OmegaConf.structured(__import__("ckptless_hpc.config", fromlist=["LocalClusterConfig"]).LocalClusterConfig)
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.mark.parametrize(
    "over,field,says",
    [
        ({"parallel.mode": "sp"}, "parallel.mode", "unknown parallel mode"),
        ({"parallel.mode": "zero", "replication.factor": 2}, "replication.factor", "at most 1 copies"),
        ({"parallel.mode": "fsdp", "train.precision": "fp16"}, "train.precision", "fp16"),
        ({"parallel.mode": "hsdp", "parallel.shard_size": 3}, "parallel.shard_size", "divides the world size 2"),
        ({"parallel.mode": "hsdp", "parallel.shard_size": 2, "cluster.nodes": 1, "cluster.workers_per_node": 4}, "parallel.shard_size", "one node loss loses it"),
        ({"parallel.mode": "zero", "replication.every": 0}, "replication.every", "must be an integer >= 1"),
    ],
)
def test_a_layout_that_cannot_keep_its_promise_is_refused(over, field, says):
    errors = validation_errors(_cfg(**over), PROBES)  # the node-loss check needs state.placement, passed in
    assert any(e.startswith(f"{field}=") and says in e and "HINT" in e for e in errors), errors


def test_sharded_layouts_that_work_are_accepted():
    assert validation_errors(_cfg(**{"parallel.mode": "zero", "cluster.nodes": 3, "replication.factor": 2})) == []
    assert validation_errors(_cfg(**{"parallel.mode": "hsdp", "parallel.shard_size": 2, "cluster.nodes": 2, "cluster.workers_per_node": 2}), PROBES) == []
    assert validation_errors(_cfg(**{"parallel.mode": "fsdp", "replication.factor": 0})) == []


def test_dry_run_shows_the_layout_and_where_each_copy_goes():
    from ckptless_hpc.launch.dryrun import placement

    lines = placement(_cfg(**{"parallel.mode": "zero", "cluster.nodes": 3, "replication.factor": 2}))
    assert any("survives 2 simultaneous node losses" in line for line in lines), lines
    assert "  rank 0's shard copied to rank(s) [1, 2]" in lines
    assert not any("every rank holds the full model" in line for line in lines)


def test_a_copy_lands_in_the_buffers_of_the_copy_it_replaces_and_keeps_its_own_bytes():
    """A holder receives each copy into the buffers of the copy it dropped (memory already
    touched: a third of its CPU per copy), never into one it still keeps; every kept copy holds
    its own step's bytes; a holder keeps no more copies than before (the durable one, the newest)."""
    store, server = _holder()
    woke = threading.Event()
    rep = Replicator(SECRET, 10, on_error=lambda e: None, on_change=woke.set)
    own = ShardStore()
    ptrs = {}
    for step in range(1, 6):
        store.durable(step - 1)  # as in a job: step s-1 is durable once s commits, before s's copy is sent
        rep.send(0, 3, step, own.snapshot(step, *_state(step)), [("127.0.0.1", server.port, "holder")])
        deadline = time.monotonic() + 10
        while not rep.is_confirmed(step):
            assert time.monotonic() < deadline, "copy never acknowledged"
            woke.wait(0.5)
            woke.clear()
        ptrs[step] = {n: t.data_ptr() for n, t in store.held[3][step][0]}
        for kept in store.held[3]:  # what it keeps is each step's own state, untouched by the newest
            assert state_sha256(*store.held[3][kept]) == state_sha256(*_state(kept)), (step, kept)
    assert ptrs[3] == ptrs[1] and ptrs[4] == ptrs[2] and ptrs[5] == ptrs[3]  # step s lands where s-2 was
    assert not set(ptrs[5].values()) & set(ptrs[4].values()) and sorted(store.held[3]) == [4, 5]
    rep.close()
    server.close()


def test_a_holder_lands_every_copy_in_reused_buffers_whichever_comes_first_its_commit_or_the_copy():
    """A holder's commit of step s (durable s-1) and the arrival of the copy of step s come in
    either order from one step to the next; every copy after the first few lands in buffers of
    a dropped copy (never fresh memory, never a copy still held), within three sets."""
    from ckptless_hpc.state.transfer import Received

    store = ShardStore()
    buffers = set()
    orders = ["commit first", "copy first", "copy first", "commit first", "commit first", "copy first", "commit first", "copy first", "copy first"] * 2
    for step, order in enumerate(orders, start=1):
        if order == "commit first":
            store.durable(step - 1)
        reuse = store.landing(0)
        held = {t.data_ptr() for c in store.held.get(0, {}).values() for _, t in c[0]}
        if step > 3:
            assert reuse, f"step {step} ({order}): no buffers to land in"
        t = reuse.get("w", torch.empty(4))
        assert t.data_ptr() not in held, "a copy landed in the buffers of a copy still held"
        t.fill_(step)
        buffers.add(t.data_ptr())
        store.keep(0, step, Received([("w", t)], {"step": step}, 16, 0.0))
        if order == "copy first":
            store.durable(step - 1)
        assert sorted(store.held[0])[-1] == step and all(float(c[0][0][1][0]) == s for s, c in store.held[0].items())
    assert len(buffers) <= 3


@pytest.mark.parametrize("stalls", ["reading", "acking"])
def test_a_push_to_a_holder_that_stalls_ends_within_its_timeout(stalls):
    """Nothing waits forever (issue 30): a holder that stops reading its copy, or never acks it,
    fails the push after ``timeout_s`` without progress, instead of holding the replicator. The
    holder stays stalled until the push has returned (no wall-clock bound: a push that waited
    for the holder would never return, and the test's timeout would fail it)."""
    from ckptless_hpc.state.transfer import TransferError, push_state

    release = threading.Event()

    def landing(shard):
        if stalls == "reading":
            release.wait()
        return {}

    def receiver(gen, shard, step, got):
        release.wait()

    server = StateServer("127.0.0.1", SECRET, lambda *a, **k: None, receiver=receiver, landing=landing)
    entries = [("model.w", torch.zeros(8 << 20))]  # 32 MB: more than the socket buffers take
    try:
        with pytest.raises(TransferError, match="holder"):
            push_state("127.0.0.1", server.port, SECRET, 0, 1, 2, entries, {"step": 2}, 1.0)
    finally:
        release.set()
        server.close()
