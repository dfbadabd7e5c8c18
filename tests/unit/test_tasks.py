"""Unit tests for ckptless_hpc.tasks: purity of batches, determinism, learnability, helpers."""

from __future__ import annotations

import hashlib
import math
import types

import pytest
import torch

from ckptless_hpc.tasks import LMTask, MLPTask, Task, corpus_splits, load_corpus, lr_at, mix_seed
from ckptless_hpc.tasks.base import num_parameters

OPTIM = types.SimpleNamespace(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
CORPUS_SHA256 = "2a95af4ac93f5b719944030ce3769070ddf827d847cba42192afa8da989e5dc4"

TASKS = {
    "mlp": lambda: MLPTask(),
    "lm": lambda: LMTask(d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=4),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _as_tuple(batch) -> tuple[torch.Tensor, ...]:
    return tuple(batch)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_as_tuple(a), _as_tuple(b)))


@pytest.mark.timeout(30)
def test_mix_seed_pinned_values() -> None:
    assert mix_seed(0) == 29183270196851321
    assert mix_seed(1, 2, 3) == 9159687488696154063
    assert mix_seed(2**70, -5) == 1390335176096883614
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert 0 <= mix_seed(7, 7) < 2**63
    with pytest.raises(TypeError):
        mix_seed(1.5)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_seed_global_leaves_the_cpu_generator_as_torch_manual_seed_does() -> None:
    from ckptless_hpc.tasks.base import seed_global

    torch.manual_seed(mix_seed(3, 4))
    want = (torch.get_rng_state(), torch.rand(5))
    seed_global(mix_seed(3, 4))
    got = (torch.get_rng_state(), torch.rand(5))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.timeout(30)
def test_lr_at_warmup_then_cosine() -> None:
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    warm = [lr_at(s, **kw) for s in range(10)]
    assert warm[0] == pytest.approx(0.1) and warm[-1] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(warm, warm[1:]))
    decay = [lr_at(s, **kw) for s in range(10, 111)]
    assert decay[0] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_at(60, **kw) == pytest.approx(0.55)  # cosine midpoint
    assert lr_at(110, **kw) == pytest.approx(0.1) == lr_at(500, **kw)
    assert lr_at(0, lr=2.0, warmup_steps=0, total_steps=5, min_lr_ratio=0.0) == 2.0
    with pytest.raises(ValueError, match="min_lr_ratio"):
        lr_at(0, lr=1.0, warmup_steps=0, total_steps=5, min_lr_ratio=2.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(TASKS))
def test_batch_is_pure_function_of_step_rank_world_seed(name: str) -> None:
    task = TASKS[name]()
    ref = task.batch(5, 1, 4, _gen(42))
    assert _same(ref, task.batch(5, 1, 4, _gen(42)))
    assert _same(ref, TASKS[name]().batch(5, 1, 4, _gen(42)))  # a fresh task object too
    for other in [(5, 0, 4, 42), (6, 1, 4, 42), (5, 1, 2, 42), (5, 1, 4, 43)]:
        step, rank, world, seed = other
        assert not _same(ref, task.batch(step, rank, world, _gen(seed))), other
    # Neither the global RNG nor python's random module is consulted.
    torch.manual_seed(123)
    a = task.batch(5, 1, 4, _gen(42))
    torch.manual_seed(999)
    assert _same(a, task.batch(5, 1, 4, _gen(42)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(TASKS))
def test_build_model_deterministic_under_manual_seed(name: str) -> None:
    task = TASKS[name]()

    def build(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return task.build_model().state_dict()

    a, b, c = build(0), build(0), build(1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.timeout(30)
def test_mlp_training_reduces_loss() -> None:
    task = MLPTask()
    torch.manual_seed(0)
    model = task.build_model()
    opt = task.build_optimizer(model, types.SimpleNamespace(**{**vars(OPTIM), "lr": 1e-2}))
    held_out = task.batch(10_000, 0, 1, _gen(7))
    with torch.no_grad():
        before = task.loss(model, held_out).item()
    for step in range(150):
        loss = task.loss(model, task.batch(step, 0, 1, _gen(1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = task.loss(model, held_out).item()
    assert after < 0.6 * before, (before, after)


@pytest.mark.timeout(30)
def test_lm_loss_near_log256_at_init_and_drops() -> None:
    task = LMTask()
    torch.manual_seed(0)
    model = task.build_model()
    opt = task.build_optimizer(model, OPTIM)
    losses = []
    for step in range(12):
        loss = task.loss(model, task.batch(step, 0, 1, _gen(3)))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert math.isfinite(losses[0]) and abs(losses[0] - math.log(256)) < 0.5, losses[0]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.timeout(30)
def test_training_is_bitwise_reproducible_with_dropout() -> None:
    """Same (seed, step, rank) -> identical weights, with the framework-style per-step reseed."""
    task = LMTask(d_model=32, n_layers=2, n_heads=4, seq_len=16, batch_size=4, dropout=0.1)

    def train() -> dict[str, torch.Tensor]:
        torch.manual_seed(mix_seed(11, -1))
        model = task.build_model()
        opt = task.build_optimizer(model, OPTIM)
        for step in range(4):
            torch.manual_seed(mix_seed(11, step, 0))
            loss = task.loss(model, task.batch(step, 0, 2, _gen(mix_seed(11, step, 0))))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.state_dict()

    a, b = train(), train()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(30)
def test_lm_batch_shapes_and_split() -> None:
    task = LMTask(seq_len=32, batch_size=3)
    x, y = task.batch(0, 0, 1, _gen(0))
    assert x.shape == y.shape == (3, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    xv, _ = task.batch(0, 0, 1, _gen(0), split="val")
    assert xv.shape == (3, 32) and not torch.equal(x, xv)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"tie_embeddings": False}, {"d_model": 48, "n_layers": 3, "n_heads": 3, "seq_len": 10}],
)
def test_lm_num_parameters_matches_model(kwargs: dict) -> None:
    task = LMTask(**kwargs)
    torch.manual_seed(0)
    assert task.num_parameters() == num_parameters(task.build_model())
    assert str(task.num_parameters()) in task.describe()


@pytest.mark.timeout(30)
def test_describe_and_default_optimizer() -> None:
    task = MLPTask()
    assert "MLPTask" in task.describe() and str(task.num_parameters()) in task.describe()
    torch.manual_seed(0)
    model = task.build_model()
    assert task.num_parameters() == num_parameters(model)
    opt = task.build_optimizer(model, OPTIM)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["lr"] == OPTIM.lr and group["betas"] == (0.9, 0.95)
    assert group["eps"] == OPTIM.eps and group["weight_decay"] == OPTIM.weight_decay
    assert task.state_dict() == {}


@pytest.mark.timeout(30)
def test_base_describe_counts_without_touching_global_rng() -> None:
    class Tiny(Task):
        def build_model(self) -> torch.nn.Module:
            return torch.nn.Linear(3, 2)

    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert Tiny().describe() == "Tiny: 8 parameters"
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: LMTask(n_heads=5), r"task\.n_heads=5 must divide task\.d_model=128\. HINT"),
        (lambda: LMTask(vocab="bpe"), r"task\.vocab='bpe'.*HINT"),
        (lambda: LMTask(dropout=1.5), r"task\.dropout=1\.5.*HINT"),
        (lambda: LMTask(d_model=0), r"task\.d_model=0.*HINT"),
        (lambda: LMTask(seq_len=10**7), r"task\.seq_len=10000000.*HINT"),
        (lambda: MLPTask(hidden=-1), r"task\.hidden=-1.*HINT"),
        (lambda: MLPTask(classes=1), r"task\.classes=1.*HINT"),
    ],
)
def test_bad_task_arguments_raise_valueerror(factory, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()


@pytest.mark.timeout(30)
def test_corpus_is_shipped_cached_and_split() -> None:
    data = load_corpus()
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert 400_000 <= len(data) <= 500_000
    assert hashlib.sha256(data.numpy().tobytes()).hexdigest() == CORPUS_SHA256
    assert load_corpus() is data
    train, val = corpus_splits()
    assert len(train) + len(val) == len(data)
    assert 0.09 < len(val) / len(data) < 0.11
    assert b"statement" in train[:2000].numpy().tobytes()
