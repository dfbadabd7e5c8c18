"""Issue 32, "Proofs, round four": breaks that no test caught, each given a direct, fast test.

Each test's docstring names the break it catches (applied by hand in a private worktree: the
test fails with it, passes without). Real tensors, real engines over real gloo groups (ranks as
threads of this process, as tests/unit/test_engine_two_ranks.py does), real sockets and a real
fork; the only stand-in is a held ``emergency.write`` (break 1), to make the race deterministic.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

import plain_loop
from ckptless_hpc.config import Config, LocalClusterConfig
from ckptless_hpc.control import listener, wire
from ckptless_hpc.control.listener import Listener
from ckptless_hpc.control.messages import PeriodicSaved
from ckptless_hpc.coordinator.saved_copies import SavedCopies
from ckptless_hpc.coordinator.saving import Saver
from ckptless_hpc.rundir.paths import INDEX
from ckptless_hpc.state import emergency, export
from ckptless_hpc.state.snapshot import state_sha256
from ckptless_hpc.tasks.mlp import MLPTask
from ckptless_hpc.train.comm import Communicator
from ckptless_hpc.train.engine import Engine
from ckptless_hpc.train.evaluation import ValSource
from ckptless_hpc.worker import periodic
from ckptless_hpc.worker.periodic import PeriodicCopies

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e" / "tasks_for_tests"))
import engine_tasks as T  # noqa: E402

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- engines on ranks


def _cfg(parallel: str = "ddp", nodes: int = 1, steps: int = 6, **train):
    c = OmegaConf.structured(Config(task={}, cluster=LocalClusterConfig()))
    c.train.steps, c.optim.lr, c.parallel.mode, c.cluster.nodes = steps, 0.05, parallel, nodes
    for k, v in train.items():
        c.train[k] = v
    return c


def _group(store, rank: int, size: int, holders=None) -> Communicator:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=60)
    return Communicator(dist.ProcessGroupGloo(store, rank, size, opts), 0, rank, size, holders=holders)


class Ranks:
    """One engine per process of a job, each process a thread over a real gloo group on a
    HashStore (``holders``: the ranks each process trains, a job that shrank). The processes
    share torch's global RNG, so each computes under a lock, let go only while it waits for a
    collective (as tests/unit/test_engine_two_ranks.py does)."""

    def __init__(self, make_task, cfg, holders=None) -> None:
        world = int(cfg.cluster.nodes) * int(cfg.cluster.workers_per_node)
        size = world if holders is None else len(holders)
        store, self.lock = dist.HashStore(), threading.Lock()
        comms: List[Any] = [None] * size
        threads = [threading.Thread(target=lambda r=r: comms.__setitem__(r, _group(store, r, size, holders))) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.engines = [Engine(cfg, make_task(), torch.device("cpu"), world=world) for _ in range(size)]  # in turn: the seeded init
        for e, c in zip(self.engines, comms):
            e.bind(c)
            e.hold(c.vranks)

    def wait(self, futures) -> None:
        self.lock.release()  # the others compute while this one waits
        try:
            for f in futures:
                f.wait()
        finally:
            self.lock.acquire()

    def on_all(self, fn) -> list:
        """``fn(engine)`` on every process at once, each under the lock; their results."""
        out: list = [None] * len(self.engines)
        errors: list = []

        def run(r: int) -> None:
            try:
                with self.lock:
                    out[r] = fn(self.engines[r])
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        workers = [threading.Thread(target=run, args=(r,)) for r in range(len(self.engines))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(90)
        assert not errors, errors
        return out

    def train(self, steps: range) -> list:
        return self.on_all(lambda e: [e.step(s, lambda: None, self.wait) for s in steps])


def _one_rank(task, **train) -> Engine:
    """An engine of a 1-rank job over a real 1-rank gloo group."""
    e = Engine(_cfg(**train), task, torch.device("cpu"), world=1)
    e.bind(_group(dist.HashStore(), 0, 1))
    return e


def _wait(futures) -> None:
    for f in futures:
        f.wait()


# ---------------------------------------------------------------------------- break 1


def test_a_periodic_copy_holds_the_bytes_of_its_step_while_the_next_step_updates_the_live_tensors(tmp_path, monkeypatch):
    """Issue 32, break 1: the periodic copy taken without ``.clone()`` (worker/periodic.py).
    The writer thread is held until the next step has updated the parameters and the optimizer
    moments in place, as training does while a copy is written; the file must still hold the
    bytes of the step it is labelled with."""
    e = _one_rank(MLPTask(), steps=20)
    for s in range(3):
        e.step(s, lambda: None, _wait)
    entries, meta = e.collect(3)
    want = state_sha256([(n, t.clone()) for n, t in entries], meta)
    updated = threading.Event()
    real_write = emergency.write

    def held_write(path, entries, meta, describe=""):
        assert updated.wait(60), "the test never let the writer go"
        return real_write(path, entries, meta, describe=describe)

    monkeypatch.setattr(periodic.emergency, "write", held_write)
    sent: list = []
    cfg = SimpleNamespace(train=SimpleNamespace(save_every=3, steps=20), parallel=SimpleNamespace(mode="ddp", shard_size=None))
    copies = PeriodicCopies(cfg, str(tmp_path), sent.append)
    copies.after_commit(3, 0, [0], e.collect)  # what the worker does once step 3 is committed
    e.step(3, lambda: None, _wait)  # training goes on over the live tensors, in place
    assert state_sha256(*e.collect(3)) != want, "the next step changed nothing: the case proves nothing"
    updated.set()
    copies._writing.join(60)
    assert len(sent) == 1 and isinstance(sent[0], PeriodicSaved), sent
    got_entries, got_meta = emergency.read(sent[0].path, sent[0].state_sha256)
    assert got_meta["step"] == 3
    assert state_sha256(got_entries, got_meta) == want, "the copy labelled step 3 holds other bytes than step 3's"
    e.close()


# ---------------------------------------------------------------------------- break 2


class Accuracy(T.BatchNormSGD):
    """BatchNorm, dropout, SGD groups and two metrics of its own: the accuracy (the model's)
    and a constant 1 (its mean over the ranks and micro-batches is 1 whatever the model). Every
    value it reports is kept (``seen``), to compute the plain means from."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: List[float] = []

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        self.seen.append(float(accuracy))
        return F.cross_entropy(logits, y), {"accuracy": accuracy, "one": 1.0}


#: three ranks on three processes, on two (either way round, rank 0 anywhere) and on one
SHRUNK = (None, [[0, 2], [1]], [[1], [2, 0]], [[2, 1, 0]])


def test_the_task_metrics_of_a_shrunk_layout_are_the_plain_means():
    """Issue 32, break 2: ``Replicated._fixed_step`` (train.reduction=fixed, a process training
    several ranks) not zeroing the task's metric sums between the ranks it trains (break:
    ``restart_sums`` zeroes only the loss). The loss and the weights stay right, the metrics
    do not: here each step's metrics must be the same on 3, 2 and 1 processes, and equal to the
    means over the world x K micro-batches of the plain loop (tests/plain_loop.py)."""
    steps, k = 4, 2
    cfg = _cfg("ddp", nodes=3, steps=steps, reduction="fixed", grad_accum=k)
    plain = Accuracy()
    plain_loop.train(plain, cfg)
    per_step = 3 * k
    assert len(plain.seen) == steps * per_step
    want = [sum(plain.seen[s * per_step : (s + 1) * per_step]) / per_step for s in range(steps)]
    first = None
    for layout in SHRUNK:
        ranks = Ranks(Accuracy, cfg, holders=layout)
        results = ranks.train(range(steps))
        metrics = [[r.metrics for r in rs] for rs in results]
        assert all(m == metrics[0] for m in metrics), f"{layout}: the processes report different metrics: {metrics}"
        assert [m["one"] for m in metrics[0]] == [1.0] * steps, f"{layout}: the mean of a constant 1 is {[m['one'] for m in metrics[0]]}"
        got = [m["accuracy"] for m in metrics[0]]
        assert got == pytest.approx(want, abs=1e-12), f"{layout}: accuracy {got}, the plain loop's {want}"
        if first is None:
            first = metrics[0]
        assert metrics[0] == first, f"layout {layout} reports other metrics than {SHRUNK[0]}"
        for e in ranks.engines:
            e.close()


# ---------------------------------------------------------------------------- break 3


class HookedNan(T.NanAtStepMLP):
    """A non-finite loss at ``nan_steps`` and an ``on_step_end`` hook that counts its calls per step."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: List[int] = []

    def on_step_end(self, model, optimizer, step):
        self.calls.append(step)


class HookedMLP(MLPTask):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: List[int] = []

    def on_step_end(self, model, optimizer, step):
        self.calls.append(step)


def test_on_step_end_does_not_run_after_a_step_skipped_for_a_nonfinite_loss():
    """Issue 32, break 3: ``on_step_end`` run after a skipped step (train.on_nonfinite=skip):
    tasks/base.py promises it runs only after an optimizer update that was committed."""
    e = _one_rank(HookedNan(nan_steps=[2, 4]), on_nonfinite="skip", steps=10, max_skipped_fraction=0.5)
    results = [e.step(s, lambda: None, _wait) for s in range(6)]
    assert [r.skipped for r in results] == [None, None, "nonfinite", None, "nonfinite", None]
    assert all(r.committed for r in results)
    assert e.task.calls == [0, 1, 3, 5], f"on_step_end ran after steps {e.task.calls}"
    e.close()


def test_on_step_end_does_not_run_after_an_fp16_overflow_step():
    """Issue 32, break 3: ``on_step_end`` run after a step the fp16 grad scaler skipped (inf
    gradients: no update)."""
    e = _one_rank(HookedMLP(), precision="fp16", steps=10)
    e.scaler.load_state_dict({"scale": 2.0**120, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0})
    first = e.step(0, lambda: None, _wait)
    assert first.committed and first.skipped == "overflow", first
    e.scaler.load_state_dict({"scale": 2.0**8, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0})
    second = e.step(1, lambda: None, _wait)
    assert second.committed and second.skipped is None, second
    assert e.task.calls == [1], f"on_step_end ran after steps {e.task.calls}"
    e.close()


# ---------------------------------------------------------------------------- break 4

JITTER = textwrap.dedent(
    """
    import asyncio, json, random, sys, time

    from ckptless_hpc.control import wire  # imported by the zygote, before it forks
    from ckptless_hpc.state import fetch
    from ckptless_hpc.state.transfer import Want


    class Enough(Exception):
        pass


    def pauses(draw, n=5):
        got = []

        def sleep(s):
            got.append(s)
            if len(got) >= n:
                raise Enough

        async def asleep(s):
            sleep(s)

        real, areal = time.sleep, asyncio.sleep
        time.sleep, asyncio.sleep = sleep, asleep
        try:
            draw()
        except Enough:
            pass
        finally:
            time.sleep, asyncio.sleep = real, areal
        return got


    def main(argv):
        port = int(argv[0])
        out = {
            "connect_paced": pauses(lambda: wire.connect_paced("127.0.0.1", port, "s", timeout_s=3600, first_wait_s=1)),
            "aconnect_paced": pauses(lambda: asyncio.run(wire.aconnect_paced("127.0.0.1", port, "s", timeout_s=3600, first_wait_s=1))),
            "fetch": pauses(lambda: fetch.fetch([fetch.Source("w0", "127.0.0.1", port)], "s", Want(0, 1), 5.0, rounds=10)),
            "random": [random.random() for _ in range(5)],
        }
        print("JITTER " + json.dumps(out), flush=True)
    """
)


def test_workers_forked_by_the_zygote_draw_different_jitter(tmp_path):
    """Issue 32, break 4: the jitter RNG shared by the workers the local fork server forks (an
    RNG made before the fork, in the zygote, and not reseeded in each child): all of them would
    back off in lockstep. Two workers forked from one zygote back off from a refused port
    (wire.connect_paced, aconnect_paced, a state fetch's retries; the pauses recorded instead of
    slept) and draw from Python's ``random``: every sequence must differ between them."""
    from ckptless_hpc.launch.local import Zygote

    (tmp_path / "fakejitter.py").write_text(JITTER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nobody listens there: every attempt is refused at once

    async def scenario() -> list:
        z = Zygote(env, str(tmp_path), target="fakejitter:main")
        try:
            kids = [await z.fork([str(port)], str(tmp_path / f"w{i}.log"), 0, f"w{i}") for i in range(2)]
            return [await asyncio.wait_for(k.wait(), 90) for k in kids]
        finally:
            await z.close()

    assert asyncio.run(scenario()) == [0, 0], [(tmp_path / f"w{i}.log").read_text()[-2000:] for i in range(2)]
    drawn = []
    for i in range(2):
        lines = [ln for ln in (tmp_path / f"w{i}.log").read_text().splitlines() if ln.startswith("JITTER ")]
        assert lines, (tmp_path / f"w{i}.log").read_text()[-2000:]
        drawn.append(json.loads(lines[-1][len("JITTER ") :]))
    for what in ("connect_paced", "aconnect_paced", "fetch"):
        assert len(drawn[0][what]) == 5 and len(drawn[1][what]) == 5, (what, drawn)
    same = [what for what in drawn[0] if drawn[0][what] == drawn[1][what]]
    assert not same, f"two forked workers drew the same jitter ({', '.join(same)}): {drawn}"


# ---------------------------------------------------------------------------- break 5

SHARDS = 12  # "shard10" sorts before "shard2" as text: wrong from 11 shards on


def _write_shards(folder: Path, step: int, order) -> dict:
    """A 12-shard copy of FSDP's layout (state/export.py): shard i holds row i of ``param/w``
    (the rows concatenate in shard order) and the whole buffer. The record of each file."""
    recs = {}
    for i in order:
        entries = [("param/w", torch.full((1, 3), float(i))), ("buffer/b", torch.arange(2.0))]
        recs[i] = emergency.write(str(folder / f"shard{i}.pt"), entries, {"step": step})
    return recs


def _rows(model: dict) -> List[int]:
    return [int(v) for v in model["w"][:, 0].tolist()]


def test_a_copy_of_twelve_shards_is_indexed_exported_and_resumed_in_shard_order(tmp_path):
    """Issue 32, break 5: shards ordered as text (shard10 before shard2). A periodic copy of 12
    shards (pieces arriving in any order): its index lists the shards 0..11; the export joins the
    rows in shard order with its index and without it (a folder of shard files); a resume maps
    each shard to its own file; the newest of the copies of steps 9 and 10 is step 10's."""
    copies = SavedCopies(str(tmp_path), shards=SHARDS, keep=2, mode="fsdp")
    for step in (9, 10):
        folder = tmp_path / "saved" / f"step{step}"
        folder.mkdir(parents=True)
        order = [5, 11, 0, 10, 2, 1, 9, 3, 8, 4, 7, 6]
        recs = _write_shards(folder, step, order)
        for i in order:
            rec = copies.add(SimpleNamespace(path=recs[i]["path"], step=step, shard=i, state_sha256=recs[i]["sha256"], sha256="-", bytes=recs[i]["bytes"]))
    assert rec is not None and copies.newest["step"] == 10
    assert list(rec["shards"]) == [str(i) for i in range(SHARDS)]
    folder = tmp_path / "saved" / "step10"
    index = json.loads((folder / INDEX).read_text())
    assert list(index["files"]) == [str(i) for i in range(SHARDS)], list(index["files"])
    assert all(index["files"][str(i)]["file"] == f"shard{i}.pt" for i in range(SHARDS))
    assert _rows(export.load_full_model(str(folder))) == list(range(SHARDS))
    assert _rows(export.load_full_model(str(tmp_path))) == list(range(SHARDS))  # the run directory: its newest copy
    assert export.shard_files(str(tmp_path))[0][0].endswith(os.path.join("step10", "shard0.pt"))
    resume = export.resume_record(str(folder), SHARDS)
    assert resume["step"] == 10 and all(resume["shards"][str(i)]["path"].endswith(f"shard{i}.pt") for i in range(SHARDS)), resume
    (folder / INDEX).unlink()  # a folder of shard files, no index
    files, none = export.shard_files(str(folder))
    assert none is None and [os.path.basename(f) for f in files] == [f"shard{i}.pt" for i in range(SHARDS)]
    assert _rows(export.load_full_model(str(folder))) == list(range(SHARDS))
    resume = export.resume_record(str(folder), SHARDS)
    assert all(resume["shards"][str(i)]["path"].endswith(f"shard{i}.pt") for i in range(SHARDS)), resume


def test_the_final_state_of_twelve_shards_is_exported_from_its_files_in_shard_order(tmp_path):
    """Issue 32, break 5: the coordinator's final save (coordinator/saving.py) hands the
    exporter the shard files as text would order them. Twelve writers, each answering its
    ``save`` (as a worker's reader would record it): the ``export`` asks for shard0..shard11."""
    workers = {f"w{r}": SimpleNamespace(rank=r, role="active") for r in range(SHARDS)}
    record = SimpleNamespace(
        paths=SimpleNamespace(final_state=str(tmp_path / "final" / "state"), final_model=str(tmp_path / "final" / "model.pt")),
        shard_saves={},
        final=None,
        save_error=None,
    )
    sent: list = []

    def send(worker, msg):
        sent.append(msg)
        if msg["type"] == "save":
            record.shard_saves[int(msg["shard"])] = {"path": msg["path"], "step": msg["step"], "sha256": "-"}
        elif msg["type"] == "export":
            record.final = {"model": msg["out"]}

    async def wait(cond, timeout_s):
        return cond()

    saver = Saver(
        cfg=SimpleNamespace(train=SimpleNamespace(steps=40), cluster=SimpleNamespace(recovery_timeout_s=30)),
        record=record,
        job=SimpleNamespace(members=SimpleNamespace(workers=workers, ranks={r: f"w{r}" for r in range(SHARDS)})),
        layout=SimpleNamespace(sharded=True, shard_of={r: r for r in range(SHARDS)}),
        control=SimpleNamespace(send=send),
        launcher=None,
        wait=wait,
        emit=None,
        persist=None,
        off_loop=None,
        finish=None,
    )
    done = {w: SimpleNamespace(adopted=[]) for w in reversed(list(workers))}
    assert asyncio.run(saver.save_final(done)) == {"model": record.paths.final_model}
    (exp,) = [m for m in sent if m["type"] == "export"]
    assert [os.path.basename(f) for f in exp["files"]] == [f"shard{i}.pt" for i in range(SHARDS)], exp["files"]


# ---------------------------------------------------------------------------- break 7a


def test_connections_that_fail_or_end_free_their_listener_slots(monkeypatch):
    """Issue 32, break 7a: a listener slot never freed (control/listener.py). Twice as many
    connections as there are handshake slots fail their handshake (a wrong answer, or closed
    before answering), and twice as many as there are served slots are served and end: each
    must give its slot back, so that one more peer is still served (it used to show only as a
    job wedged until a 240 s timeout). Each client waits for the server's side to be over (its
    refusal reported; the server closing the connection, after the slot is given back)."""
    secret = wire.new_secret()
    rejects: List[Tuple[Any, str]] = []

    def handle(conn, addr):
        wire.recv_msg(conn)
        wire.send_msg(conn, {"type": "served"})

    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = sock.getsockname()[1]
    monkeypatch.setattr(listener, "EVICT_AGE_S", 3600.0)  # a stale slot is never evicted here: it must be given back
    lst = Listener(sock, secret, handle, "slots test", preauth=2, authed=2, handshake_s=30.0, on_reject=lambda a, why: rejects.append((a, why))).start()

    def refused(client: socket.socket) -> str:
        mine = client.getsockname()[1]
        deadline = time.monotonic() + 30
        while True:
            hits = [w for a, w in rejects if a[1] == mine]
            if hits:
                return hits[0]
            assert time.monotonic() < deadline, f"no refusal of client port {mine}: {rejects}"
            time.sleep(0.01)

    def peer(i: int) -> None:
        try:
            c = wire.connect("127.0.0.1", port, secret, timeout_s=10)
            with c:
                wire.send_msg(c, {"type": "ask"})
                c.settimeout(10)
                assert wire.recv_msg(c)["type"] == "served"
                assert c.recv(1) == b"", "the server kept a served connection open"  # closed: its slot is free again
        except ConnectionError as e:
            pytest.fail(f"peer {i} was not served ({e}); the listener's refusals: {[w for _, w in rejects]}")

    try:
        for i in range(4):  # 2 handshake slots: each failure must give its slot back
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            try:
                assert wire.recv_msg(c)["type"] == "challenge"
            except ConnectionError:
                pytest.fail(f"connection {i} was refused its handshake: the slots of the failed ones were not given back; refusals: {[w for _, w in rejects]}")
            if i % 2 == 0:
                c.sendall(wire.encode({"type": "auth", "mac": "0" * 64, "nonce": "ab" * 16}))
            else:
                c.shutdown(socket.SHUT_WR)  # gone before answering
            why = refused(c)
            c.close()
            assert "within" not in why, why  # failed, not timed out: the test never waits for the deadline
        for i in range(5):  # 2 served slots: each connection that ends must give its slot back
            peer(i)
        assert [w for _, w in rejects][4:] == [], rejects
    finally:
        lst.close()


# ---------------------------------------------------------------------------- break 7b


def _plain_eval(task, model, batches: int) -> dict:
    """The oracle: a plain no_grad loop over validation batches 0..M-1, each metric's mean."""
    val = ValSource(task, 0)
    model.eval()
    with torch.no_grad():
        rows = [task.evaluate(model, val.batch(i, 0, 1)) for i in range(batches)]
    model.train()
    return {k: sum(float(r[k]) for r in rows) / batches for k in rows[0]}


def _zero_model(engines) -> torch.nn.Module:
    """The model every ZeRO rank will hold once synced: each parameter as its owner stepped it."""
    model = copy.deepcopy(engines[0].model)
    sd = model.state_dict()
    for e in engines:
        own = e.strategy.partition.own.model_keys
        sd.update({k: v.clone() for k, v in e.model.state_dict().items() if k in own})
    model.load_state_dict(sd)
    return model


def test_a_zero_evaluation_right_after_a_step_sees_every_owners_parameters():
    """Issue 32, break 7b: ZeRO's evaluation without the owners' parameter sync (Engine.evaluate
    ->  Zero.begin). Fault-free, two ranks: the evaluation right after a step must be the plain
    evaluation of the model the owners stepped, not of a rank's stale copy of the others'."""
    batches = 4
    ranks = Ranks(lambda: T.ShardedRichMLP(), _cfg("zero", nodes=2, steps=6, eval_every=2, eval_batches=batches))
    ranks.train(range(2))
    synced = _zero_model(ranks.engines)
    want = _plain_eval(ranks.engines[0].task, synced, batches)
    stale = _plain_eval(ranks.engines[0].task, copy.deepcopy(ranks.engines[0].model), batches)
    assert stale["loss"] != pytest.approx(want["loss"], rel=1e-9), "rank 0's copy is not stale after a step: the case proves nothing"
    values = ranks.on_all(lambda e: e.evaluate(2, ranks.wait))
    assert values[0] == values[1]
    for k, v in want.items():
        assert values[0][k] == pytest.approx(v, rel=1e-9, abs=1e-12), f"{k}: the evaluation saw {values[0][k]}, the synced model gives {v} (a stale copy: {stale[k]})"
    for e in ranks.engines:
        e.close()


# ---------------------------------------------------------------------------- break 7c


def test_an_adopted_zero_shard_takes_its_ranks_scheduler_state():
    """Issue 32, break 7c: an adopted ZeRO shard's scheduler state not loaded (Zero.apply with a
    lost rank's ``shard``). Rank 1's shard after 4 steps (its own OneCycleLR at step 4) applied to
    a survivor that adopts rank 1: the adopted part's scheduler is at step 4 with rank 1's LR,
    and the part's whole state (meta included) is rank 1's."""
    steps = 4
    cfg = _cfg("zero", nodes=2, steps=12)
    ranks = Ranks(lambda: T.ShardedRichMLP(), cfg)
    ranks.train(range(steps))
    lost = ranks.engines[1]
    entries, meta = lost.collect(steps)
    assert meta["scheduler"]["last_epoch"] == steps
    survivor = Engine(cfg, T.ShardedRichMLP(), torch.device("cpu"), world=2)
    survivor.take_rank(0)
    survivor.hold([0, 1])
    part = survivor.strategy.partition.part(1)
    assert part.scheduler.last_epoch == 0
    survivor.apply(entries, meta, copy=True, shard=1)
    own = lost.strategy.partition.own
    assert part.scheduler.last_epoch == steps, f"the adopted part's scheduler is at step {part.scheduler.last_epoch}"
    assert part.scheduler.get_last_lr() == own.scheduler.get_last_lr()
    assert part.scheduler.state_dict() == own.scheduler.state_dict()
    assert state_sha256(*survivor.collect(steps, shard=1)) == state_sha256(*lost.collect(steps))
    assert survivor.strategy.partition.own.scheduler.last_epoch == 0  # the survivor's own part is untouched
    for e in [*ranks.engines, survivor]:
        e.close()
