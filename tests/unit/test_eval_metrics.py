"""Evaluation, a task's own metrics and on_step_end, in the engine: 2 ranks in-process (two
threads over a real gloo group on a HashStore) where the cross-rank average matters, one rank
where it does not. The oracle of an evaluation is a plain ``no_grad`` loop over the same
batches with the same weights in this process."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from ckptless_hpc.config import Config, LocalClusterConfig
from ckptless_hpc.state.snapshot import state_sha256
from ckptless_hpc.tasks.mlp import MLPTask
from ckptless_hpc.train.comm import Communicator
from ckptless_hpc.train.data import StepBatches
from ckptless_hpc.train.engine import Engine
from ckptless_hpc.train.evaluation import ValSource, eval_due, eval_indices

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.ema import EMATask  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _cfg(**train):
    c = OmegaConf.structured(Config(task={}, cluster=LocalClusterConfig()))
    c.train.steps = train.pop("steps", 6)
    for k, v in train.items():
        c.train[k] = v
    return c


class Probe(EMATask):
    """Metrics whose global mean is known: the first input of each micro-batch, and the rank."""

    def loss(self, model, batch):
        loss, metrics = super().loss(model, batch)
        return loss, {**metrics, "x00": batch[0][0, 0], "one": 1.0}


def _comms(world: int):
    store = dist.HashStore()
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    out = [None] * world

    def form(r):
        out[r] = Communicator(dist.ProcessGroupGloo(store, r, world, opts), 0, r, world)

    threads = [threading.Thread(target=form, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _wait(futures):
    for f in futures:
        f.wait()


def _on_ranks(engines, fn):
    """``fn(engine)`` on every rank at once (threads: the collectives need all of them)."""
    out, errors = [None] * len(engines), []

    def run(r):
        try:
            out[r] = fn(engines[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    if errors:
        raise errors[0]
    return out


def _engines(make_task, world=2, **train):
    engines = [Engine(_cfg(**train), make_task(), torch.device("cpu"), world=world) for _ in range(world)]  # built in turn: the seeded init
    for e, c in zip(engines, _comms(world)):
        e.bind(c)
    return engines


def _plain_eval(task, model, batches):
    """The oracle: a plain no_grad loop over batches 0..M-1, the mean of each metric."""
    val = ValSource(task, 0)
    model.eval()
    with torch.no_grad():
        rows = [task.evaluate(model, val.batch(i, 0, 1)) for i in range(batches)]
    model.train()
    return {k: sum(float(r[k]) for r in rows) / batches for k in rows[0]}


def test_own_metrics_are_the_mean_over_ranks_and_micro_batches():
    engines = _engines(lambda: Probe(), grad_accum=3)
    results = _on_ranks(engines, lambda e: [e.step(s, lambda: None, _wait) for s in range(2)])
    src = StepBatches(Probe(), 0, 2, 3)
    for step in range(2):
        want = sum(float(src.batch(step, m, r)[0][0, 0]) for r in range(2) for m in range(3)) / 6
        for rank_results in results:
            got = rank_results[step].metrics
            assert got["x00"] == pytest.approx(want, rel=1e-12, abs=1e-15)
            assert got["one"] == 1.0 and 0.0 <= got["accuracy"] <= 1.0
    assert results[0][1].metrics == results[1][1].metrics


def test_evaluation_equals_a_plain_no_grad_loop_and_leaves_the_state_alone():
    engines = _engines(lambda: EMATask(), eval_every=2, eval_batches=5)
    _on_ranks(engines, lambda e: [e.step(s, lambda: None, _wait) for s in range(3)])
    before = [state_sha256(*e.collect(3)) for e in engines]
    values = _on_ranks(engines, lambda e: e.evaluate(3, _wait))
    assert values[0] == values[1]  # every rank gets the same means
    assert set(values[0]) == {"loss", "accuracy", "ema_loss", "ema_accuracy"}
    want = _plain_eval(engines[0].task, engines[0].model, 5)
    for k, v in want.items():
        assert values[0][k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert values[0]["loss"] != values[0]["ema_loss"]  # the EMA weights are not the model's
    assert all(e.model.training for e in engines)
    assert [state_sha256(*e.collect(3)) for e in engines] == before
    again = _on_ranks(engines, lambda e: e.evaluate(3, _wait))
    assert again == values  # deterministic: a redone evaluation gives the same values


def test_evaluation_spreads_the_batches_over_the_ranks():
    assert eval_indices(0, 2, 5) == [(0, 1.0), (2, 1.0), (4, 1.0)]
    assert eval_indices(1, 2, 5) == [(1, 1.0), (3, 1.0), (0, 0.0)]  # as many forwards as rank 0, the last counts for nothing
    assert eval_indices(2, 4, 2) == [(0, 0.0)]
    assert [s for s in range(1, 11) if eval_due(s, 4, 10)] == [4, 8, 10]
    assert not any(eval_due(s, 0, 10) for s in range(11))


class BNEval(MLPTask):
    """BatchNorm and dropout: an evaluation must not move the running statistics."""

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(self.input_dim, self.hidden), torch.nn.BatchNorm1d(self.hidden), torch.nn.Dropout(0.5), torch.nn.Linear(self.hidden, self.classes))

    def val_batch(self, index, rank, world, generator):
        return self.batch(index, 0, 1, generator)

    def evaluate(self, model, batch):
        x, y = batch
        assert not model.training and not torch.is_grad_enabled()
        return {"loss": F.cross_entropy(model(x), y)}


def test_evaluation_in_eval_mode_keeps_running_stats_and_one_rank_matches_the_oracle():
    (e,) = _engines(lambda: BNEval(), world=1, eval_every=1, eval_batches=3)
    e.step(0, lambda: None, _wait)
    before = state_sha256(*e.collect(1))
    got = e.evaluate(1, _wait)
    assert state_sha256(*e.collect(1)) == before and e.model.training
    assert got["loss"] == pytest.approx(_plain_eval(e.task, e.model, 3)["loss"], rel=1e-12)


class Renaming(MLPTask):
    def loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        return super().loss(model, batch), {f"m{self.calls % 2}": 1.0}


class RankNamed(MLPTask):
    rank = 0

    def loss(self, model, batch):
        return super().loss(model, batch), {f"rank{self.rank}": 1.0}


def test_metric_names_must_stay_the_same_over_steps_and_ranks():
    (e,) = _engines(lambda: Renaming(), world=1, grad_accum=2)
    with pytest.raises(ValueError, match=r"Renaming.loss returned the metrics \['m0'\], earlier \['m1'\].*HINT"):
        e.step(0, lambda: None, _wait)
    engines = _engines(lambda: RankNamed())
    engines[1].task.rank = 1
    with pytest.raises(ValueError, match="different metric names on different ranks.*HINT"):
        _on_ranks(engines, lambda e: e.step(0, lambda: None, _wait))


def test_on_step_end_state_is_carried_bitwise():
    """The EMA of a run given its state at step 3 (a replacement's) continues bitwise."""
    (a,) = _engines(lambda: EMATask(), world=1)
    for s in range(3):
        a.step(s, lambda: None, _wait)
    entries, meta = a.collect(3)
    assert any(k.startswith("task.ema.") for k, _ in entries)
    (b,) = _engines(lambda: EMATask(), world=1)
    b.apply([(k, t.clone()) for k, t in entries], meta)
    for s in range(3, 6):
        a.step(s, lambda: None, _wait)
        b.step(s, lambda: None, _wait)
    assert state_sha256(*a.collect(6)) == state_sha256(*b.collect(6))
    fresh = EMATask()
    fresh.build_model()
    assert not torch.equal(a.task.ema["0.weight"], fresh.ema["0.weight"])  # it moved


def test_on_step_end_with_zero_is_refused():
    c = _cfg()
    c.parallel.mode = "zero"
    with pytest.raises(ValueError, match="on_step_end with parallel.mode=zero.*HINT"):
        Engine(c, EMATask(), torch.device("cpu"), world=1)


def test_eval_every_without_evaluate_is_refused():
    with pytest.raises(ValueError, match="MLPTask has neither val_dataset.*HINT"):
        Engine(_cfg(eval_every=2), MLPTask(), torch.device("cpu"), world=1)
