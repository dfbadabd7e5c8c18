"""Fetching a state in parts and groups from several real StateServers over real sockets; the
formation barrier on a real authenticated store."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from ckptless_hpc.control.rendezvous import AuthStore, StoreServer
from ckptless_hpc.state.fetch import Source, fetch, groups_for, source_for
from ckptless_hpc.state.snapshot import collect_state, state_sha256
from ckptless_hpc.state.transfer import Arena, StaleState, StateServer, TransferError, Want, select
from ckptless_hpc.train.comm import store_barrier
from ckptless_hpc.tasks.mlp import MLPTask

pytestmark = pytest.mark.timeout(60)
SECRET = "x" * 32


def _state():
    """A trained replica's state: several layers, AdamW moments and steps (optim.*)."""
    torch.manual_seed(0)
    task = MLPTask(hidden=64)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        loss = task.loss(model, task.batch(s, 0, 1, torch.Generator().manual_seed(s)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return collect_state(model, opt, task, 2)


def _sizes(entries):
    return sum(t.numel() * t.element_size() for _, t in entries)


def test_groups_are_disjoint_cover_the_part_in_order_and_are_balanced():
    entries, _ = _state()
    for part in ("all", "first", "rest"):
        whole = select(entries, part)
        assert whole == [e for e in entries if part == "all" or e[0].startswith("optim.") == (part == "rest")]
        for of in (1, 2, 3, 4):
            groups = [select(entries, part, i, of) for i in range(of)]
            assert [n for g in groups for n, _ in g] == [n for n, _ in whole]  # disjoint, complete, canonical order
            biggest = max(t.numel() * t.element_size() for _, t in whole)
            assert max(_sizes(g) for g in groups) <= _sizes(whole) / of + biggest  # balanced up to one entry
    assert {n for n, _ in select(entries, "first")} | {n for n, _ in select(entries, "rest")} == {n for n, _ in entries}
    with pytest.raises(ValueError, match="part='params': unknown part of the state. HINT"):
        select(entries, "params")
    with pytest.raises(ValueError, match="group 2 of 2: no such group"):
        select(entries, "all", 2, 2)


def test_sources_rotate_per_group_and_attempt():
    assert groups_for(3, 4) == 3 and groups_for(6, 4) == 4 and groups_for(1, 4) == 1 and groups_for(0, 4) == 1
    assert [source_for(0, a, 3) for a in range(4)] == [0, 1, 2, 0]
    assert [source_for(2, a, 3) for a in range(3)] == [2, 0, 1]


class _Source:
    """A real StateServer serving a state, counting what it was asked for; ``damage`` the
    first ``n`` requests (truncate: the source dying mid-way, as far as the receiver can tell)."""

    def __init__(self, entries, meta, damage=None, n=0, refuse=False):
        self.entries, self.meta, self.damage, self.n, self.refuse = entries, meta, damage, n, refuse
        self.asked = []
        self.server = StateServer("127.0.0.1", SECRET, self.provide)
        self.src = Source(f"w{self.server.port}", "127.0.0.1", self.server.port)

    def provide(self, gen, step, shard=None, part="all"):
        self.asked.append(part)
        if self.refuse:
            raise StaleState("holds another step")
        if self.damage and self.n > 0:
            self.n -= 1
            return self.entries, self.meta, self.damage, "optimizer" if part == "rest" else "first"
        return self.entries, self.meta


def test_a_part_comes_in_groups_from_several_sources_at_once_and_matches_the_whole():
    entries, meta = _state()
    a, b, c = (_Source(entries, meta) for _ in range(3))
    try:
        arena = Arena(_sizes(entries) + (1 << 16))
        got = fetch([a.src, b.src, c.src], SECRET, Want(1, 2, None, "all"), 10, arena, parallel=4)
        assert set(got.by_source) == {a.src.worker, b.src.worker, c.src.worker}  # one group from each
        assert state_sha256(got.received.entries, got.received.meta) == state_sha256(entries, meta)
        first = fetch([a.src, b.src], SECRET, Want(1, 2, None, "first"), 10, parallel=4)
        rest = fetch([a.src, b.src], SECRET, Want(1, 2, None, "rest"), 10, parallel=1)
        assert set(rest.by_source) == {a.src.worker}  # parallel=1: one source at a time
        assert all(not n.startswith("optim.") for n, _ in first.received.entries)
        assert all(n.startswith("optim.") for n, _ in rest.received.entries)
        assert first.received.nbytes + rest.received.nbytes == _sizes(entries)
    finally:
        for s in (a, b, c):
            s.server.close()


@pytest.mark.parametrize("damage, words", [("corrupt", "checksum mismatch"), ("truncate", "truncated")])
def test_a_group_that_fails_comes_from_another_source(damage, words):
    entries, meta = _state()
    bad, good = _Source(entries, meta, damage, n=5), _Source(entries, meta)
    errors = []
    try:
        got = fetch([bad.src, good.src], SECRET, Want(1, 2, None, "rest"), 10, parallel=2, on_error=lambda s, w, e: errors.append((s.worker, w, str(e))))
        assert got.by_source == {good.src.worker: got.received.nbytes}  # both groups from the good one in the end
        assert state_sha256(got.received.entries, got.received.meta) == state_sha256(select(entries, "rest"), meta)
        assert errors and all(w == bad.src.worker and words in e and want.part == "rest" for w, want, e in errors)
        assert bad.asked and set(bad.asked) == {"rest"}
    finally:
        bad.server.close()
        good.server.close()


def test_every_attempt_failing_is_an_error_naming_them():
    entries, meta = _state()
    a, b = _Source(entries, meta, refuse=True), _Source(entries, meta, "corrupt", n=99)
    try:
        with pytest.raises(TransferError, match=r"optimizer state of step 2: group\(s\) \[0, 1\] of 2 failed every attempt") as e:
            fetch([a.src, b.src], SECRET, Want(1, 2, None, "rest"), 10, rounds=2)
        assert "refused" in str(e.value) and "checksum mismatch" in str(e.value)
        assert len(a.asked) + len(b.asked) == 2 * 2 * 2  # two groups, two rounds over two sources
        assert set(e.value.sources) == {a.src.worker, b.src.worker}  # whom the coordinator blames, not the fetcher
        with pytest.raises(TransferError, match="named no source"):
            fetch([], SECRET, Want(1, 2), 10)
    finally:
        a.server.close()
        b.server.close()


def test_a_source_nobody_can_reach_is_named_as_the_one_that_failed():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there
    with pytest.raises(TransferError, match="cannot reach state source") as e:
        fetch([Source("gone.0", "127.0.0.1", port)], SECRET, Want(1, 2), 10, rounds=2)
    assert e.value.sources == ("gone.0",)


def test_sources_disagreeing_on_the_metadata_are_refused():
    entries, meta = _state()
    a, b = _Source(entries, meta), _Source(entries, {**meta, "skipped": {"nonfinite": 1, "overflow": 0}})
    try:
        with pytest.raises(TransferError, match="metadata differs"):
            fetch([a.src, b.src], SECRET, Want(1, 2), 10)
    finally:
        a.server.close()
        b.server.close()


def test_store_barrier_holds_every_rank_until_the_last_arrives():
    server = StoreServer("127.0.0.1", SECRET)
    world = 3
    passed = []
    threads = []

    def rank(r):
        store = AuthStore("127.0.0.1", server.port, SECRET, 30)
        store_barrier(torch.distributed.PrefixStore("gen4", store), world, 30)
        passed.append(r)

    try:
        for r in range(world - 1):
            threads.append(threading.Thread(target=rank, args=(r,), daemon=True))
            threads[-1].start()
        for t in threads:
            t.join(0.5)
        assert passed == [] and all(t.is_alive() for t in threads)  # held: the third rank has not arrived
        rank(world - 1)
        for t in threads:
            t.join(20)
        assert sorted(passed) == [0, 1, 2]
        other = AuthStore("127.0.0.1", server.port, SECRET, 30)
        assert not other.check(["gen5/formed/open"])  # another generation's barrier is its own
    finally:
        server.close()


def test_optimizer_state_is_served_during_a_step_only_before_the_update():
    """A source serves the optimizer state of the step it trains, in the same generation, until
    its own update (engine.state_step None) changes it; never while its own is still arriving."""
    from types import SimpleNamespace

    from ckptless_hpc.worker.interrupt import Waiter
    from ckptless_hpc.worker.peer_state import PeerState
    from ckptless_hpc.worker.standing import Standing

    standing = Standing("local0")
    standing.gen, standing.step = 3, 12
    cfg = SimpleNamespace(cluster=SimpleNamespace())
    w = PeerState(cfg, SimpleNamespace(state_step=12), None, "s" * 32, None, Waiter(), None, standing, "local0.0")
    assert w.serves_behind(3, 12)
    assert not w.serves_behind(4, 12) and not w.serves_behind(2, 12)  # another generation's fetcher does not gate our update
    assert not w.serves_behind(3, 11)
    w.engine.state_step = None  # inside the optimizer update
    assert not w.serves_behind(3, 12)
    w.engine.state_step, w.behind = 12, object()  # its own optimizer state still arriving
    assert not w.serves_behind(3, 12)
    w.behind, w.shards = None, object()  # sharded state: never (a shard is served whole, not while training)
    assert not w.serves_behind(3, 12)
