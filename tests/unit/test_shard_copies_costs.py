"""What a sharded rank's copies cost it, as the ``done`` message reports it (bench B8's floor):
the waits of its steps for acks, its snapshots and their bytes, the bytes sent to holders."""

from __future__ import annotations

import threading
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
    assert costs == {"wait_s": 0.75, "waits": 2, "snapshots": 3, "snapshot_bytes": 3 * 256 * 4, "sent_bytes": 0}
