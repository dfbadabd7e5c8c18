"""The real engine on two ranks in one process (two threads over a real 2-rank gloo group on a
HashStore), against the same training as a plain PyTorch loop (tests/plain_loop.py): the
cross-rank effects (the mean over ranks and micro-batches, the global clip, rank 0's buffers on
every rank, ZeRO's owners) visible in a second, without starting a job.

Both ranks share torch's global RNG in one process, so each rank's forward and backward run
under a lock (seeded, then computed, as in its own process); the lock is let go only while a
rank waits for a collective. FSDP2 issues collectives inside its forward and is proven by the
end-to-end test (tests/e2e/test_plain_pytorch.py) instead.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import plain_loop
from ckptless_hpc.config import Config, LocalClusterConfig
from ckptless_hpc.train.comm import Communicator
from ckptless_hpc.train.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e" / "tasks_for_tests"))
import engine_tasks as T  # noqa: E402

pytestmark = pytest.mark.timeout(120)
STEPS = 6


def _cfg(parallel: str = "ddp", nodes: int = 2, **train):
    c = OmegaConf.structured(Config(task={}, cluster=LocalClusterConfig()))
    c.train.steps, c.optim.lr, c.parallel.mode, c.cluster.nodes = STEPS, 0.05, parallel, nodes
    for k, v in train.items():
        c.train[k] = v
    return c


def _group(store, rank: int, size: int, holders=None):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=60)
    return Communicator(dist.ProcessGroupGloo(store, rank, size, opts), 0, rank, size, holders=holders)


def _train_two_ranks(make_task, cfg, holders=None):
    """Every process's engine after cfg.train.steps steps, and their step results: a process
    per rank of the config (two by default), or one per entry of ``holders`` (the ranks each
    one trains: a job that shrank)."""
    world = int(cfg.cluster.nodes) * int(cfg.cluster.workers_per_node)
    size = world if holders is None else len(holders)
    store, lock = dist.HashStore(), threading.Lock()
    comms = [None] * size
    threads = [threading.Thread(target=lambda r=r: comms.__setitem__(r, _group(store, r, size, holders))) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    engines = [Engine(cfg, make_task(), torch.device("cpu"), world=world) for _ in range(size)]
    results: list = [[] for _ in range(size)]
    errors: list = []

    def wait(futures):
        lock.release()  # the other rank computes while this one waits
        try:
            for f in futures:
                f.wait()
        finally:
            lock.acquire()

    def rank(r: int) -> None:
        try:
            engines[r].bind(comms[r])
            engines[r].hold(comms[r].vranks)  # ZeRO: the lost ranks' parts of the optimizer too
            for step in range(STEPS):
                with lock:
                    results[r].append(engines[r].step(step, lambda: None, wait))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    workers = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(90)
    assert not errors, errors
    return engines, results


def _like_plain(case, got, want) -> None:
    """The engine's model within 1e-5 (relative) of the plain PyTorch loop's."""
    diffs = plain_loop.max_differences(got, want)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= 1e-5, f"{case}: {worst} differs from plain PyTorch by {diffs[worst]:.3g} of its magnitude; all: {diffs}"


def _clip_bit(case, results) -> None:
    """A clipping case proves something only if the gradient needed clipping."""
    if "clip" in case:
        assert min(r.grad_norm for r in results) > 0.05, "the gradient never needed clipping: the case proves nothing"


CASES = {
    "adamw_builtin_schedule": (lambda: T.MLPTask(), "ddp", {}),
    "grad_accum_sgd_groups": (lambda: T.SGDGroupsMLP(), "ddp", dict(grad_accum=3)),
    "clip_bites": (lambda: T.SGDGroupsMLP(), "ddp", dict(clip_grad_norm=0.05)),
    "buffers_dropout": (lambda: T.BatchNormSGD(), "ddp", dict(grad_accum=2)),
    "bf16": (lambda: T.SGDGroupsMLP(), "ddp", dict(precision="bf16")),
    "fp16_scaler": (lambda: T.SGDGroupsMLP(), "ddp", dict(precision="fp16", grad_accum=2)),
    "zero_groups_accum_clip": (lambda: T.SGDGroupsMLP(), "zero", dict(grad_accum=2, clip_grad_norm=0.05)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_train_what_plain_pytorch_trains(case):
    make, parallel, train = CASES[case]
    cfg = _cfg(parallel, **train)
    engines, results = _train_two_ranks(make, cfg)
    want = plain_loop.train(make(), cfg).state_dict()
    if parallel == "zero":  # each rank's own parameters are current; the others' arrive at the next step
        owned = [e.strategy.partition.own.model_keys for e in engines]
        got = {k: engines[0 if k in owned[0] else 1].model.state_dict()[k] for k in want}
    else:
        got = engines[0].model.state_dict()
        rank1 = engines[1].model.state_dict()
        assert all(torch.equal(got[k], rank1[k]) for k in got), "the replicas differ (buffers: rank 0's must be everyone's)"
    _like_plain(case, got, want)
    losses = [[r.loss for r in rs] for rs in results]
    assert losses[0] == losses[1]  # the loss is the global mean, the same on both ranks
    _clip_bit(case, results[0])


FIXED_CASES = {
    "buffers_dropout_accum_clip": (lambda: T.BatchNormSGD(), dict(grad_accum=2, clip_grad_norm=0.05)),
    "adamw_builtin_schedule": (lambda: T.MLPTask(), {}),
    "fp16_scaler": (lambda: T.SGDGroupsMLP(), dict(precision="fp16", grad_accum=2)),
    "bf16": (lambda: T.SGDGroupsMLP(), dict(precision="bf16")),
}
#: three ranks on three processes (a job that never shrank: the all-to-alls overlap backward; and
#: the same named as a shrunk layout would be), two and one (a survivor trains a lost rank too, rank 0 anywhere)
LAYOUTS = (None, [[0], [1], [2]], [[0, 2], [1]], [[1], [2, 0]], [[2, 1, 0]])


@pytest.mark.parametrize("case", list(FIXED_CASES))
def test_fixed_reduction_trains_what_plain_pytorch_trains_and_the_same_bits_on_any_number_of_processes(case):
    """train.reduction=fixed, three ranks: equal to the plain loop within tolerance, and bitwise
    the same model (parameters, BatchNorm statistics) and losses however many processes train
    the three ranks, and whichever of them trains rank 0."""
    make, train = FIXED_CASES[case]
    cfg = _cfg("ddp", nodes=3, reduction="fixed", **train)
    want = plain_loop.train(make(), cfg).state_dict()
    first = None
    for layout in LAYOUTS:
        engines, results = _train_two_ranks(make, cfg, holders=layout)
        got = engines[0].model.state_dict()
        for e in engines[1:]:
            assert all(torch.equal(got[k], v) for k, v in e.model.state_dict().items()), f"{layout}: the replicas differ"
        if first is None:
            first = (got, [r.loss for r in results[0]])
            _like_plain(case, got, want)
        else:
            assert all(torch.equal(first[0][k], v) for k, v in got.items()), f"{case}: layout {layout} trained other bits than {LAYOUTS[0]}"
            assert [r.loss for r in results[0]] == first[1], f"{case}: layout {layout}: other losses"
    _clip_bit(case, results[0])


ZERO_FIXED_CASES = {
    "adamw_builtin_schedule": (lambda: T.MLPTask(), {}),
    "own_scheduler_groups_buffers_dropout_accum_clip": (lambda: T.BatchNormSGD(), dict(grad_accum=2, clip_grad_norm=0.05)),
}


@pytest.mark.parametrize("case", list(ZERO_FIXED_CASES))
def test_zero_fixed_reduction_trains_what_plain_pytorch_trains_and_each_shard_the_same_bits_on_any_number_of_processes(case):
    """parallel=zero with train.reduction=fixed, three ranks: a process that trains lost ranks
    too steps their parts of the optimizer (each with its own optimizer and scheduler): each
    shard's state (parameters, optimizer moments, scheduler) is bitwise the same however many
    processes hold the three ranks, and the model is the plain loop's within tolerance."""
    from ckptless_hpc.state.snapshot import state_sha256

    make, train = ZERO_FIXED_CASES[case]
    cfg = _cfg("zero", nodes=3, reduction="fixed", **train)
    want = plain_loop.train(make(), cfg).state_dict()
    first = None
    for layout in LAYOUTS:
        engines, results = _train_two_ranks(make, cfg, holders=layout)
        holder = {v: e for e in engines for v in e.shards()}
        assert sorted(holder) == [0, 1, 2], f"{layout}: shards held {sorted(holder)}"
        shas = {v: state_sha256(*holder[v].collect(STEPS, shard=v)) for v in holder}
        got = {k: holder[v].model.state_dict()[k] for v in holder for k in holder[v].strategy.partition.part(v).model_keys}
        if first is None:
            first = (shas, [r.loss for r in results[0]])
            _like_plain(case, got, want)
        else:
            assert shas == first[0], f"{case}: layout {layout} holds other shards than {LAYOUTS[0]}"
            assert [r.loss for r in results[0]] == first[1], f"{case}: layout {layout}: other losses"
    _clip_bit(case, results[0])
