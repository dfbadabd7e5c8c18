"""The training engine in one process, over a real gloo group (1 rank, or 2 with the second a
thread of the test): state given and taken mid-run continues bitwise (scheduler, grad scaler,
buffers, counters carried), one reduction per step whatever the accumulation, an abandoned step
leaves the committed state and its late collectives never reach the redone step, the optimizer
state is served before the update only (through the real state server), non-finite steps, the
data source (in-process and in a DataLoader, seeking) and the refusals."""

from __future__ import annotations

import queue
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ckptless_hpc.config import Config, LocalClusterConfig
from ckptless_hpc.state.snapshot import state_sha256
from ckptless_hpc.tasks.base import seed_step
from ckptless_hpc.tasks.mlp import MLPTask
from ckptless_hpc.train.comm import Communicator
from ckptless_hpc.train.data import LoaderFeed, StepBatches, make_feed
from ckptless_hpc.train.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e" / "tasks_for_tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import engine_tasks as T  # noqa: E402
from examples.vision_cnn import CNNTask  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _cfg(**train):
    c = OmegaConf.structured(Config(task={}, cluster=LocalClusterConfig()))
    c.train.steps = train.pop("steps", 12)
    for k, v in train.items():
        c.train[k] = v
    return c


class _Counting:
    """A real 1-rank gloo communicator that counts what it is asked to do."""

    def __init__(self, gen: int = 0) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.inner = Communicator(dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts), gen, 0, 1)
        self.rank, self.world, self.calls = 0, 1, []
        self.holders, self.vranks = None, [0]

    def allreduce(self, t):
        self.calls.append(("allreduce", t.numel()))
        return self.inner.allreduce(t)

    def broadcast(self, t, root=0):
        self.calls.append(("broadcast", t.numel()))
        return self.inner.broadcast(t, root)


def _engine(task, **train) -> Engine:
    e = Engine(_cfg(**train), task, torch.device("cpu"), world=1)
    e.bind(_Counting())
    return e


def _wait(futures):
    for f in futures:
        f.wait()


def _run(e: Engine, start: int, stop: int) -> list:
    return [e.step(s, lambda: None, _wait) for s in range(start, stop)]


def _sha(e: Engine, step: int) -> str:
    return state_sha256(*e.collect(step))


CASES = {
    "bn_dropout_onecycle_accum_clip_bf16": (lambda: T.BatchNormMLP(), dict(grad_accum=3, clip_grad_norm=0.1, precision="bf16")),
    "onecycle": (lambda: T.OneCycleMLP(), {}),
    "fp16_scaler": (lambda: MLPTask(), dict(precision="fp16")),
    "cnn_dataset_in_loader": (lambda: CNNTask(batch_size=8), dict(grad_accum=2, data_workers=2, clip_grad_norm=0.5)),
    "two_dtypes_several_buckets": (lambda: T.MixedDtypeMLP(hidden=256), dict(bucket_mb=0.01)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_state_taken_mid_run_continues_bitwise(case):
    make, train = CASES[case]
    a = _engine(make(), **train)
    _run(a, 0, 6)
    b = _engine(make(), **train)
    assert _sha(b, 6) != _sha(a, 6)
    entries, meta = a.collect(6)
    b.apply([(k, t.clone()) for k, t in entries], meta)  # as received: its own memory (the optimizer keeps what it is given)
    assert _sha(b, 6) == _sha(a, 6)
    _run(a, 6, 12)
    _run(b, 6, 12)
    assert _sha(b, 12) == _sha(a, 12)
    if a.scheduler is not None:
        assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"] and b.scheduler.last_epoch == 12
    a.close()
    b.close()


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_first_then_the_optimizer_state_behind_the_step_continues_bitwise(case):
    """apply_first (model, buffers, task, scheduler/scaler scalars), the step's forward and
    backward on it, the optimizer's part only before the collectives land (as the worker does):
    the same state as the whole state applied at once."""
    from ckptless_hpc.state.transfer import select

    make, train = CASES[case]
    a = _engine(make(), **train)
    _run(a, 0, 6)
    b = _engine(make(), **train)
    entries, meta = a.collect(6)
    first = [(k, t.clone()) for k, t in select(entries, "first")]
    rest = [(k, t.clone()) for k, t in select(entries, "rest")]
    assert first and rest and {k for k, _ in first}.isdisjoint(k for k, _ in rest) and len(first) + len(rest) == len(entries)
    b.apply_first(first, meta)
    assert b.state_step is None  # not a whole state yet: never served, never saved
    landed = []
    res = b.step(6, lambda: landed.append(b.apply_rest(rest, meta)), _wait)
    assert landed and res.committed and b.state_step == 7
    _run(a, 6, 7)
    assert _sha(b, 7) == _sha(a, 7)
    _run(a, 7, 12)
    _run(b, 7, 12)
    assert _sha(b, 12) == _sha(a, 12)
    a.close()
    b.close()


def test_parameters_first_is_refused_for_sharded_state():
    c = _cfg()
    c.parallel.mode = "zero"
    e = Engine(c, MLPTask(), torch.device("cpu"), world=1)
    with pytest.raises(ValueError, match="parallel.mode=zero: parameters first is for the replicated state"):
        e.apply_first([], {"step": 0})
    e.close()


def test_one_reduction_per_step_whatever_the_accumulation():
    for k in (1, 4):
        e = _engine(T.BatchNormMLP(hidden=512), grad_accum=k, bucket_mb=0.005)
        _run(e, 0, 2)
        buckets = len(e.strategy.grads.buckets)
        assert buckets >= 3
        per_step = buckets + 1 + 2  # the buckets, the loss, rank 0's buffers (two dtypes: float32, int64)
        assert len(e.comm.calls) == 2 * per_step, e.comm.calls
        assert [kind for kind, _ in e.comm.calls].count("broadcast") == 2 * 2
        # a bucket closes once it holds the limit: at most the limit plus one parameter (the largest, 32 x 512)
        limit = int(0.005 * (1 << 20)) // 4
        assert max(b.numel() for b in e.strategy.grads.buckets) <= limit + 32 * 512


def test_an_abandoned_step_leaves_the_committed_state():
    e = _engine(T.BatchNormMLP(), grad_accum=2)
    _run(e, 0, 3)
    before = _sha(e, 3)

    def fail(futures):
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        e.step(3, lambda: None, fail)
    assert _sha(e, 3) == before  # the forward had moved the running statistics: put back


def test_a_source_serves_its_optimizer_state_before_its_update_never_during_it():
    """The real engine behind the real StateServer and fetch, as a worker serves the optimizer
    state behind a step (worker/peer_state.py): asked for step 5's while it trains step 5, it
    serves step 5's moments up to its update, and refuses from inside the update (where the
    tensors already hold step 6's moments, still labelled step 5 until the step returns)."""
    from ckptless_hpc.state.fetch import Source, fetch
    from ckptless_hpc.state.transfer import StateServer, TransferError, Want, select
    from ckptless_hpc.worker.interrupt import Waiter
    from ckptless_hpc.worker.peer_state import PeerState
    from ckptless_hpc.worker.standing import Standing

    e = _engine(MLPTask())
    _run(e, 0, 5)
    entries, meta = e.collect(5)
    want = state_sha256(select([(k, t.clone()) for k, t in entries], "rest"), meta)
    class NoFaults:
        def due(self, at, step):  # no fault injected here
            return None

    standing = Standing("local0")  # the worker's serving side, over the real engine: training step 5 of generation 3
    standing.gen, standing.step, standing.training = 3, 5, True
    secret = "s" * 32
    w = PeerState(e.cfg, e, None, secret, None, Waiter(), NoFaults(), standing, "local0.0")
    server = StateServer("127.0.0.1", secret, w.provide)
    got = {}

    def ask(when):
        try:
            r = fetch([Source("local0.0", "127.0.0.1", server.port)], secret, Want(3, 5, None, "rest"), 10, parallel=1, rounds=1)
            got[when] = state_sha256(r.received.entries, r.received.meta)
        except TransferError as err:
            got[when] = err

    hook = e.optimizer.register_step_post_hook(lambda *_: ask("update"))  # the update has moved the moments; the step has not returned
    try:
        e.step(5, lambda: ask("backward"), _wait)
    finally:
        hook.remove()  # else engine, hook and server form a cycle, freed only by a gc pass (as below)
        server.close()
    assert got["backward"] == want, got  # before the update: step 5's optimizer state
    assert isinstance(got["update"], TransferError) and "refused" in str(got["update"]), got  # never a torn or later state as step 5's
    assert e.state_step == 6
    got.clear()  # the errors' tracebacks hold this frame (and the engine, its gloo group): freed now, not by a gc pass in a forked data-loader worker


def _gloo(store, rank: int, world: int = 2):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=60)
    return dist.ProcessGroupGloo(store, rank, world, opts)


class _Pair:
    """Rank 0's communicator of a real 2-rank gloo group of one generation, whose rank 1 is a
    thread of this test taking part in each collective rank 0 issues, in order, with tensors of
    its own: zeros (the sum is rank 0's own) while it runs; ``late`` for the collectives it was
    frozen in, once thawed (a peer SIGSTOPped inside the step, SIGCONTed after the survivors
    re-formed without it)."""

    def __init__(self, store, gen: int, late: float = 0.0) -> None:
        prefixed = dist.PrefixStore(f"gen{gen}", store)
        peer = {}
        t = threading.Thread(target=lambda: peer.setdefault("pg", _gloo(prefixed, 1)), daemon=True)
        t.start()
        self.inner = Communicator(_gloo(prefixed, 0), gen, 0, 2)
        t.join(30)
        self.rank, self.world, self.late = 0, 2, late
        self.holders, self.vranks = None, [0]
        self.running = threading.Event()
        self.running.set()
        self._ops: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._peer, args=(peer["pg"],), daemon=True).start()

    def _peer(self, pg) -> None:
        while True:
            kind, like, frozen = self._ops.get()
            self.running.wait()
            mine = torch.full_like(like, self.late if frozen else 0)
            if kind == "allreduce":
                pg.allreduce([mine]).wait()
            else:
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                pg.broadcast([mine], opts).wait()

    def allreduce(self, t):
        self._ops.put(("allreduce", torch.empty_like(t), not self.running.is_set()))
        return self.inner.allreduce(t)

    def broadcast(self, t, root=0):
        self._ops.put(("broadcast", torch.empty_like(t), not self.running.is_set()))
        return self.inner.broadcast(t, root)


def test_an_abandoned_steps_late_write_never_reaches_the_redone_step():
    """Rank 1 freezes inside step 3 (its allreduces in flight on rank 0, unanswered); rank 0
    abandons the step, re-forms generation 1 with a replacement and redoes step 3; the frozen
    peer then resumes and answers generation 0's collectives, which write their sums (its
    contribution: 1000s) into the gradient memory rank 0 launched them on, before the redone
    step's update. The committed state must be the one of a run that never failed."""
    ref = Engine(_cfg(bucket_mb=0.001), MLPTask(), torch.device("cpu"), world=2)
    ref.bind(_Pair(dist.HashStore(), 0))
    _run(ref, 0, 4)
    store = dist.HashStore()
    e = Engine(_cfg(bucket_mb=0.001), MLPTask(), torch.device("cpu"), world=2)
    g0 = _Pair(store, 0, late=1000.0)
    e.bind(g0)
    _run(e, 0, 3)
    abandoned = []

    def freeze_then_abandon(futures):
        abandoned.extend(futures)
        raise RuntimeError("peer hung: step abandoned")

    g0.running.clear()
    with pytest.raises(RuntimeError, match="abandoned"):
        e.step(3, lambda: None, freeze_then_abandon)
    assert len(abandoned) > 2 and not any(f.done() for f in abandoned)  # every bucket's allreduce is still in flight
    e.bind(_Pair(store, 1))

    def land_then_thaw(futures):
        _wait(futures)  # generation 1's reduction has landed in the gradients
        g0.running.set()  # the frozen peer resumes: generation 0's collectives complete now
        _wait(abandoned)

    e.step(3, lambda: None, land_then_thaw)
    assert _sha(e, 4) == _sha(ref, 4)


def test_nonfinite_step_stop_keeps_the_state_skip_drops_it():
    stop = _engine(T.NanAtStepMLP(nan_steps=[2]))
    _run(stop, 0, 2)
    held = _sha(stop, 2)
    (res,) = _run(stop, 2, 3)
    assert not res.committed and res.loss != res.loss and _sha(stop, 2) == held
    skip = _engine(T.NanAtStepMLP(nan_steps=[2]), on_nonfinite="skip")
    _run(skip, 0, 2)
    params = [p.detach().clone() for p in skip.model.parameters()]
    (res,) = _run(skip, 2, 3)
    assert res.committed and res.skipped == "nonfinite" and skip.skipped["nonfinite"] == 1
    assert all(torch.equal(p, q) for p, q in zip(params, skip.model.parameters()))


def test_skipping_stops_past_max_skipped_fraction():
    e = _engine(T.NanAtStepMLP(nan_steps=[2, 4]), on_nonfinite="skip", steps=10, max_skipped_fraction=0.1)  # one skip allowed
    first = _run(e, 0, 3)[-1]
    assert first.committed and first.skipped == "nonfinite" and e.skipped["nonfinite"] == 1
    _run(e, 3, 4)
    held = _sha(e, 4)
    (res,) = _run(e, 4, 5)
    assert not res.committed and res.over_budget == 1 and e.skipped["nonfinite"] == 1 and _sha(e, 4) == held


def test_fp16_overflow_is_skipped_by_the_scaler_and_counted():
    e = _engine(MLPTask(), precision="fp16")
    e.scaler.load_state_dict({"scale": 2.0**120, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0})
    params = [p.detach().clone() for p in e.model.parameters()]
    (res,) = _run(e, 0, 1)
    assert res.skipped == "overflow" and e.skipped["overflow"] == 1 and e.scaler.get_scale() == 2.0**119
    assert all(torch.equal(p, q) for p, q in zip(params, e.model.parameters()))


def test_loader_gives_the_in_process_bytes_and_seeks():
    task = CNNTask(batch_size=4)
    inproc = make_feed(task, seed=3, world=2, micro_batches=2, total_steps=10, workers=0, prefetch=2)
    loader = make_feed(task, seed=3, world=2, micro_batches=2, total_steps=10, workers=2, prefetch=2)
    assert isinstance(loader, LoaderFeed)
    for feed in (inproc, loader):
        feed.bind(1)
    order = [(0, 0), (0, 1), (1, 0), (0, 0), (5, 1), (6, 0)]  # in order, back (a recovery), a jump (a replacement)
    for step, micro in order:
        a, b = inproc.get(step, micro), loader.get(step, micro)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (step, micro)
    assert loader.seeks == 3
    loader.close()


class _Indexed(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.tensor(i)


class _IndexTask(MLPTask):
    def dataset(self):
        return _Indexed()


def test_dataset_positions_cover_each_epoch_once_and_differ_by_epoch():
    task = _IndexTask(batch_size=4)
    src = StepBatches(task, seed=0, world=2, micro_batches=2)
    epoch0 = [int(i) for s in (0, 1) for m in (0, 1) for r in (0, 1) for i in src.batch(s, m, r)]
    assert sorted(epoch0) == list(range(32))  # 2 steps x 2 micro x 2 ranks x 4 = one epoch, no repeat
    epoch1 = [int(i) for s in (2, 3) for m in (0, 1) for r in (0, 1) for i in src.batch(s, m, r)]
    assert sorted(epoch1) == list(range(32)) and epoch1 != epoch0


def test_old_batch_signature_gets_a_virtual_rank_and_the_new_one_the_micro_batch():
    task = MLPTask()
    src = StepBatches(task, seed=5, world=2, micro_batches=3)
    x, _ = src.batch(4, 2, 1)
    ref, _ = task.batch(4, 1 * 3 + 2, 6, seed_step(5, 4, 5))
    assert torch.equal(x, ref)
    micro = StepBatches(T.MicroMLP(), seed=5, world=2, micro_batches=3)
    assert micro.takes_micro and not torch.equal(micro.batch(4, 0, 1)[0], micro.batch(4, 1, 1)[0])


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="source without random access.*HINT"):
        StepBatches(T.StreamTask(), seed=0, world=1, micro_batches=1)
    with pytest.raises(ValueError, match="SyncBatchNorm.*HINT"):
        Engine(_cfg(), T.SyncBNTask(), torch.device("cpu"), world=1)

    class BadScheduler(MLPTask):
        def build_scheduler(self, optimizer, optim, total_steps):
            return lambda step: 0.1

    with pytest.raises(ValueError, match="not a torch.optim.lr_scheduler scheduler.*HINT"):
        Engine(_cfg(), BadScheduler(), torch.device("cpu"), world=1)


def test_what_the_worker_asks_of_the_engine_it_gets_through_methods():
    """The agent never reaches into the engine (worker/agent.py): the built message's layout,
    whether the batches are the task's own, a spare's warm-up (FSDP2 only), the extra groups
    (hsdp only) and how a failed generation's group is let go of (FSDP2 at once, else retired)."""
    e = _engine(MLPTask())
    layout = e.layout()
    assert layout == {"buckets": len(e.strategy.grads.buckets), "buffers": sum(len(b) for _, b in e.buffers.groups)} and layout["buckets"] >= 1
    assert list(layout) == ["buckets", "buffers"]  # the built message's key order
    assert e.task_batches is (e.feed.batches.dataset is None)
    assert e.warm_up() is None  # ddp: nothing to pre-warm
    comm = object()
    e.form_groups(None, comm, "127.0.0.1", 1.0)  # ddp: no groups besides the generation's
    assert not hasattr(comm, "hsdp")
    assert e.let_go(e.comm) is False  # the caller retires a replicated generation's group once idle
