"""What a sharded rank's copies cost it, as the ``done`` message reports it (bench B8's floor):
the waits of its steps for acks, its snapshots and their bytes, the bytes sent to holders."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ckptless_hpc.worker.shard_copies import ShardCopies

pytestmark = pytest.mark.timeout(30)


class _Engine:  # collect() is all ShardCopies asks of the engine
    def collect(self, step, shard=None):
        return [("w", torch.zeros(250)), ("b", torch.zeros(6))], {"step": step}


def _copies(factor: int) -> ShardCopies:
    cfg = SimpleNamespace(parallel=SimpleNamespace(mode="zero"), replication=SimpleNamespace(every=1, factor=factor),
                          cluster=SimpleNamespace(recovery_timeout_s=5.0))
    sc = ShardCopies(cfg, "secret", client=None, wake=threading.Event())
    sc.assign(0, 0, [], [])
    return sc


def test_costs_count_the_waits_the_snapshots_and_their_bytes():
    sc = _copies(factor=1)
    engine = _Engine()
    sc.start_generation(engine, 0)
    sc.waited(0.25)
    sc.committed(engine, 1)
    sc.waited(0.5)
    sc.committed(engine, 2)
    costs = sc.costs()
    sc.replicator.close()
    assert costs == {"wait_s": 0.75, "waits": 2, "snapshots": 3, "snapshot_bytes": 3 * 256 * 4, "sent_bytes": 0, "send_cpu_s": 0.0, "receive_cpu_s": 0.0, "received": 0}


def test_the_copys_own_cpu_is_counted_at_both_ends():
    """B8 counts a copy's CPU on its own threads (time.thread_time): the sender's pushes and the
    holder's receive and keep, over a real socket to a real StateServer; one rank holds the
    other's copy. Each push of a 64 MB shard costs each end at least the CPU of moving it."""
    from ckptless_hpc.state.transfer import StateServer

    sender, holder = _copies(factor=1), _copies(factor=1)
    server = StateServer("127.0.0.1", "secret", lambda *a, **k: None, receiver=holder.keep, landing=holder.landing)
    try:
        sender.assign(0, 0, [{"worker": "w1", "host": "127.0.0.1", "port": server.port}], [])
        big = SimpleNamespace(collect=lambda step, shard=None: ([("w", torch.full((16 << 20,), float(step)))], {"step": step}))
        sender.start_generation(big, 0)
        for step in (1, 2):
            sender.committed(big, step)
            deadline = time.monotonic() + 20
            while not sender.replicator.is_confirmed(step) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sender.replicator.is_confirmed(step)
        sent, held = sender.costs(), holder.costs()
    finally:
        server.close()
        sender.replicator.close()
        holder.replicator.close()
    assert sent["sent_bytes"] == 3 * 64 << 20 and held["received"] == 3, (sent, held)
    assert torch.equal(holder.get(0, 2)[0][0][1], torch.full((16 << 20,), 2.0))  # what it holds is the copy of step 2
    assert sent["send_cpu_s"] > 0.005 and held["receive_cpu_s"] > 0.005, (sent, held)  # 192 MB moved at each end
    assert sent["receive_cpu_s"] == 0 and held["send_cpu_s"] == 0
