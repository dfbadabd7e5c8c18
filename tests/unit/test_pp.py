"""parallel=pp without processes: the config's checks, where each rank's stage comes from, the
data each rank trains on, the task's stages checked and equal to the whole model, the seeds, and
the export joining the stages' shards (disjoint names) into the whole model (the end-to-end
proof: tests/e2e/test_zoo.py, pp-llama_pp and pp_1f1b-llama_counting)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from ckptless_hpc.config import data_world, global_batch, register_configs, resume_shards, validation_errors
from ckptless_hpc.coordinator.sharding import Layout
from ckptless_hpc.launch.probes import PROBES
from ckptless_hpc.state import dcp as state_dcp
from ckptless_hpc.state import export
from ckptless_hpc.state.views import UserView, model_tensors
from ckptless_hpc.train.data import forward_seed
from ckptless_hpc.train.grouped import is_comm_error, mesh_coordinate
from ckptless_hpc.train.pp import PPStrategy, Stages, cut_stages, stage_of
from models.llama import LlamaPPTask, LlamaTask

pytestmark = pytest.mark.timeout(60)
register_configs()
PP = ("parallel=pp", "cluster.workers_per_node=2")


def cfg(*overrides: str):
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        return compose(config_name="config", overrides=["task=mlp", *overrides])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (("parallel.pp=3",), "parallel.pp=3: pp needs a pipeline size (stages per replica) that divides the world size 4"),
        (("parallel.pp=4", "cluster.nodes=1", "cluster.workers_per_node=4"), "replication.factor=1: parallel.pp=4 makes the whole world one replica"),
        (("parallel.pp=2", "cluster.nodes=1", "cluster.workers_per_node=4"), "parallel.pp=2: every replica of some shard lives on one node"),
        (("parallel.pp_schedule=zero_bubble",), "parallel.pp_schedule='zero_bubble': unknown pipeline schedule"),
        (("parallel.pp_schedule=interleaved_1f1b",), "parallel.pp_virtual=1: parallel.pp_schedule=interleaved_1f1b interleaves several stages on each rank"),
        (("parallel.pp_virtual=2",), "parallel.pp_virtual=2: parallel.pp_schedule=gpipe runs one stage per rank"),
        (("parallel.pp_virtual=0",), "parallel.pp_virtual=0: must be an integer >= 1"),
        (
            ("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2", "train.grad_accum=5"),
            "train.grad_accum=5: parallel.pp_schedule=interleaved_1f1b runs the micro-batches in 2 rounds",
        ),
        (("parallel.pp_schedule=1f1b", "train.grad_accum=1"), "train.grad_accum=1: parallel.pp_schedule=1f1b needs at least as many micro-batches as stages (parallel.pp=2)"),
        (("train.compile=true",), "train.compile=True: parallel=pp runs the stages' own modules"),
        (("cluster.nodes=3", "cluster.min_nodes=2"), "parallel.mode=pp cannot shrink yet"),
        (("parallel.param_dtype=bf16",), "FSDP2's MixedPrecisionPolicy is for parallel=fsdp|hsdp and tp x shard (parallel.shard_size > 1), not pp"),
        (("parallel.tp=0",), "parallel.tp=0: must be null or an integer >= 1"),
        (("parallel.tp=2", "cluster.nodes=3"), "parallel.pp x parallel.tp=4: pp x tp needs a replica (pp x tp ranks) that divides the world size 6"),
    ],
)
def test_a_pp_layout_that_cannot_work_is_refused_naming_the_field(overrides, needle):
    errors = validation_errors(cfg(*PP, *overrides), PROBES)
    assert any(needle in e and "HINT" in e for e in errors), errors


def test_the_layout_replicas_hold_the_same_stage_and_one_data_rank_per_pipeline():
    c = cfg(*PP, "parallel.pp=2", "cluster.nodes=3")
    assert validation_errors(c, PROBES) == []
    assert validation_errors(cfg(*PP, "parallel.pp_schedule=1f1b", "train.grad_accum=2"), PROBES) == []
    assert validation_errors(cfg(*PP, "parallel.pp=2", "train.eval_every=5"), PROBES) == []  # the last stage evaluates (pp_evaluate)
    for k in (1, 2, 4, 6):  # interleaved: at most pp micro-batches (one round), or rounds of grad_accum // pp that divide them
        assert validation_errors(cfg(*PP, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2", f"train.grad_accum={k}"), PROBES) == []
    lay = Layout(c)
    assert lay.shard_of == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1} and lay.shards == 2 and lay.factor == 0
    assert lay.survives() == 2 and "pipelines of 2 stages, 3 replicas of each stage's shard" in lay.describe()
    assert data_world(c) == 3 and "x world 3" in global_batch(c, 4) and resume_shards(c) == 2


def test_the_dry_run_prints_the_pipelines_and_where_each_stage_lives():
    from ckptless_hpc.launch.dryrun import placement

    lines = placement(cfg(*PP, "parallel.pp=2", "cluster.nodes=3"))
    assert "mesh: 3 replica(s) x pp 2 (replica r, stage s = rank r*2+s)" in lines
    assert "  replica 1: s0=rank 2@local1, s1=rank 3@local1" in lines
    assert "  Stage 1: held by 3 replica(s) on 3 node(s) (local0, local1, local2)" in lines
    assert any("survives 2 simultaneous node losses" in x for x in lines)


@pytest.mark.parametrize("n_layers, n_stages", [(2, 2), (4, 2), (4, 3)])
def test_the_stages_hold_the_models_own_parameters_once_and_compose_to_the_model(n_layers, n_stages):
    """Every stage keeps the whole model's names; the stages' names are disjoint and cover the
    model; running the stages one after another is the model's forward, bit for bit, and the
    pipeline's loss is the task's."""
    task = LlamaPPTask(n_layers=n_layers)
    torch.manual_seed(0)
    full = task.build_model()
    names = {n for n, _ in full.named_parameters()}
    stages = [stage_of(task, copy.deepcopy(full), s, n_stages) for s in range(n_stages)]
    held = [{n for n, _ in st.named_parameters()} for st in stages]
    assert set().union(*held) == names and sum(map(len, held)) == len(names)
    assert "tok_embeddings.weight" in held[0] and "output.weight" in held[-1] and "norm.weight" in held[-1]
    batch = task.batch(0, 0, 1, torch.Generator().manual_seed(1))
    h, y = _through(stages, task, batch)
    assert torch.equal(h, full(task.pp_split(batch)[0]))
    assert torch.equal(task.pp_loss(h, y), task.loss(full, batch))
    got, want = task.pp_evaluate(h, y), task.evaluate(full, batch)  # the last stage's evaluation is the task's
    assert got.keys() == want.keys() == {"loss", "accuracy"} and all(torch.equal(got[k], want[k]) for k in want)


def _through(stages, task, batch):
    """The batch's inputs through ``stages`` one after another (a pipeline in one process), and its target."""
    h, y = task.pp_split(batch)
    for st in stages:
        h = st(h)
    return h, y


def test_a_task_without_stages_or_with_wrong_ones_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"parallel=pp needs LlamaTask.pp_stage.*HINT"):
        stage_of(LlamaTask(), LlamaTask().build_model(), 0, 2)

    class Renamed(LlamaPPTask):
        def pp_stage(self, model, stage, n_stages):
            return torch.nn.Sequential(model.tok_embeddings, model.layers["0"]) if stage == 0 else super().pp_stage(model, stage, n_stages)

    with pytest.raises(ValueError, match=r"the stage's parameter 0.weight is not the model's parameter of that name.*HINT"):
        stage_of(Renamed(), Renamed().build_model(), 0, 2)

    class Tied(LlamaPPTask):
        def build_model(self):
            m = super().build_model()
            m.output.weight = m.tok_embeddings.weight  # embedding on the first stage, head on the last
            return m

    with pytest.raises(ValueError, match=r"tied to \['output.weight'\], which another stage holds.*HINT"):
        stage_of(Tied(), Tied().build_model(), 0, 2)
    with pytest.raises(ValueError, match=r"pp_stage\(1, 3\) has no parameters.*HINT"):
        stage_of(LlamaPPTask(n_layers=1), LlamaPPTask(n_layers=1).build_model(), 1, 3)


def test_evaluation_without_pp_evaluate_is_refused_with_a_hint():
    conf = OmegaConf.create({"parallel": {"mode": "pp", "pp": 2, "pp_schedule": "gpipe"}, "train": {"seed": 7, "eval_every": 4}})
    with pytest.raises(ValueError, match=r"train.eval_every is set with parallel=pp, but LlamaTask has no pp_evaluate\(output, target\).*HINT"):
        PPStrategy(SimpleNamespace(cfg=conf, model=None, optimizer=None, task=LlamaTask()))
    assert PPStrategy(SimpleNamespace(cfg=conf, model=None, optimizer=None, task=LlamaPPTask())).eval_schedule is None


def _strategy(module, optimizer, task, stage: int, pp: int = 2, virtual: int = 1) -> PPStrategy:
    """A PPStrategy over one stage (``virtual`` > 1: one rank's stages), without groups (collect and apply only)."""
    sched = "interleaved_1f1b" if virtual > 1 else "gpipe"
    conf = OmegaConf.create({"parallel": {"mode": "pp", "pp": pp, "pp_schedule": sched, "pp_virtual": virtual}, "train": {"seed": 7}})
    s = PPStrategy(SimpleNamespace(cfg=conf, model=module, optimizer=optimizer, task=task))
    s.module, s.stage_index = module, stage
    return s


def test_the_stages_shards_join_into_the_model_and_its_optimizer():
    """What each stage's rank saves (PPStrategy.collect: its own parameters, buffers and optimizer
    state under the whole model's names) joins, by name, into the whole model (final/model.pt,
    export: loadable strictly into the task's model) and the whole optimizer's state (final/dcp);
    a copy missing a stage is refused."""
    task = LlamaPPTask(n_layers=3)
    torch.manual_seed(0)
    full = task.build_model()
    opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    for s in range(2):
        task.loss(full, task.batch(s, 0, 1, torch.Generator().manual_seed(s))).backward()
        opt.step()
        opt.zero_grad()
    view = UserView.of(full).to_json([n for n, _ in model_tensors(full)])
    shards = []
    for s in range(2):
        mine, mine_opt = copy.deepcopy((full, opt))
        stage = task.pp_stage(mine, s, 2)
        stage_opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
        for p in stage.parameters():
            stage_opt.state[p] = mine_opt.state[p]
        shards.append(_strategy(stage, stage_opt, task, s).collect(2, {"user_view": view}))
    assert not {n for n, _ in shards[0][0] if n.startswith("param/")} & {n for n, _ in shards[1][0] if n.startswith("param/")}
    got = export.full_model(shards, build_model=task.build_model)  # its fused wqkv is presented as wq/wk/wv by a fresh model
    want = full.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    task.build_model().load_state_dict(got)  # strict
    merged = state_dcp.optimizer_state(shards)
    for n, p in full.named_parameters():
        assert all(torch.equal(merged["state"][n][k], v) for k, v in opt.state[p].items()), n
    assert sorted(merged["param_groups"][0]["params"]) == sorted(n for n, _ in full.named_parameters())
    with pytest.raises(export.ExportError, match=r"missing \[.layers.1.attention.wo.weight.*HINT"):
        export.full_model(shards[:1], build_model=task.build_model)


def test_a_stage_loads_the_same_stage_of_another_replica():
    """A spare's stage takes the entries another replica's same stage collected (recovery)."""
    task = LlamaPPTask()
    torch.manual_seed(0)
    a = task.pp_stage(task.build_model(), 1, 2)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    task.pp_loss(a(torch.randn(2, 5, task.dim)), torch.randint(0, task.vocab, (2, 5))).backward()
    opt_a.step()
    torch.manual_seed(1)
    b = task.pp_stage(task.build_model(), 1, 2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    entries, meta = _strategy(a, opt_a, task, 1).collect(1, {})
    assert _strategy(b, opt_b, task, 1).apply(entries, meta)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(torch.equal(opt_a.state[p]["exp_avg"], opt_b.state[q]["exp_avg"]) for p, q in zip(a.parameters(), b.parameters()))


def test_each_micro_batch_is_seeded_for_its_data_rank_the_first_stage_as_the_engine():
    """Stage 0 draws what the one-process reference draws for the same data rank and micro-batch
    (its dropout is the reference's); a later stage draws a stream of its own."""
    first, later = _strategy(None, None, None, 0), _strategy(None, None, None, 1)
    first._step = later._step = 3
    draws = {}
    for name, s in (("first", first), ("later", later)):
        s._seed(1, s.stage_index, 2)
        draws[name] = torch.rand(4)
    forward_seed(7, 3, 1, 2)
    assert torch.equal(draws["first"], torch.rand(4)) and not torch.equal(draws["later"], draws["first"])


def test_an_interleaved_ranks_stages_are_looped_and_join_into_the_model():
    """parallel.pp_virtual=2 on pipelines of 2: rank s holds stages s and s+2 of 4 (torch's looped
    placement), cut from copies of one model; its ``Stages`` presents their parameters and buffers
    under the model's names, each once (the rotary table both hold is one tensor); the ranks'
    names are disjoint and cover the model; the four stages in order are the model's forward;
    ``eval()`` reaches every stage; trained a step, the ranks' shards (collect) join into the model
    trained the same way (export), and a rank's shard loads into another replica's same rank."""
    task = LlamaPPTask(n_layers=4)
    torch.manual_seed(0)
    full = task.build_model()
    ranks = []
    for s in range(2):
        ids = _strategy(None, None, task, s, virtual=2).stage_ids()
        module = Stages(cut_stages(task, copy.deepcopy(full), ids, 4))
        ranks.append(_strategy(module, torch.optim.AdamW(module.parameters(), lr=1e-2), task, s, virtual=2))
        ranks[-1].stage_modules = list(module.stages)
    assert [r.stage_ids() for r in ranks] == [[0, 2], [1, 3]]
    names = [[n for n, _ in r.module.named_parameters()] for r in ranks]
    assert not set(names[0]) & set(names[1]) and sorted(names[0] + names[1]) == sorted(n for n, _ in full.named_parameters())
    assert "layers.2.attention.wqkv.weight" in names[0] and "output.weight" in names[1]
    a, b = ranks[0].stage_modules
    assert [n for n, _ in ranks[0].module.named_buffers()] == ["freqs_cis"] and a.freqs_cis is b.freqs_cis
    ranks[0].module.eval()
    assert not b.training
    ranks[0].module.train()
    order = [ranks[0].stage_modules[0], ranks[1].stage_modules[0], ranks[0].stage_modules[1], ranks[1].stage_modules[1]]
    batch = task.batch(0, 0, 1, torch.Generator().manual_seed(1))
    h, y = _through(order, task, batch)
    assert torch.equal(h, full(task.pp_split(batch)[0]))
    task.pp_loss(h, y).backward()
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    task.loss(full, batch).backward()
    for opt in [r.e.optimizer for r in ranks] + [full_opt]:
        opt.step()
    view = UserView.of(full).to_json([n for n, _ in model_tensors(full)])
    shards = [r.collect(1, {"user_view": view}) for r in ranks]
    got, want = export.full_model(shards, build_model=task.build_model), full.state_dict()
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)
    torch.manual_seed(1)
    other = Stages(cut_stages(task, task.build_model(), [0, 2], 4))
    spare = _strategy(other, torch.optim.AdamW(other.parameters(), lr=1e-2), task, 0, virtual=2)
    assert spare.apply(*shards[0])
    assert all(torch.equal(p, q) for p, q in zip(ranks[0].module.parameters(), other.parameters()))


def test_pp_x_tp_replicas_are_pipelines_of_tp_groups_each_coordinate_held_by_every_replica():
    """parallel=pp with parallel.tp=2: a replica is pp x tp ranks (rank r*4 + s*2 + t: a stage's
    TP group consecutive, on one node), its coordinate (stage, TP rank) the shard every replica
    holds; the data is split over the replicas; the dry run prints the 2-D mesh; parallel=tp with
    parallel.pp set is refused, pointing at this layout."""
    c = cfg("parallel=pp", "parallel.pp=2", "parallel.tp=2", "cluster.workers_per_node=4")
    assert validation_errors(c, PROBES) == []
    lay = Layout(c)
    assert lay.shard_of == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1, 6: 2, 7: 3} and lay.survives() == 1
    assert "pipelines of 2 stages x tensor parallel 2, 2 replicas of each (stage, TP rank)'s shard" in lay.describe()
    assert data_world(c) == 2 and resume_shards(c) == 4
    assert [mesh_coordinate(r, 2, 2) for r in (0, 1, 2, 3, 6)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0)]
    from ckptless_hpc.launch.dryrun import placement

    lines = placement(c)
    assert "mesh: 2 replica(s) x pp 2 x tp 2 (replica r, stage s, TP rank t = rank r*4+s*2+t)" in lines
    assert "  replica 1: s0t0=rank 4@local1, s0t1=rank 5@local1, s1t0=rank 6@local1, s1t1=rank 7@local1" in lines
    assert "  Coordinate s1t0: held by 2 replica(s) on 2 node(s) (local0, local1)" in lines
    errors = validation_errors(cfg("parallel=tp", "parallel.pp=2", "cluster.workers_per_node=2"), PROBES)
    assert any("parallel.pp=2: parallel=tp has no pipeline" in e and "use parallel=pp parallel.pp=2 parallel.tp=2" in e for e in errors), errors


def test_pp_x_tp_shards_join_along_each_stages_own_shard_dims():
    """Each stage's ranks name the shard dimensions of their own stage only: the export and the
    optimizer's merge join every stage's TP shards by the union of the shards' dimensions."""
    a, b = torch.arange(8.0).reshape(2, 4), torch.arange(6.0).reshape(3, 2)
    shards = [
        ([("param/a", a[:1]), ("optim/a/exp_avg", a[:1])], {"shard_dims": {"a": 0}}),
        ([("param/a", a[1:]), ("optim/a/exp_avg", a[1:])], {"shard_dims": {"a": 0}}),
        ([("param/b", b[:, :1])], {"shard_dims": {"b": 1}}),
        ([("param/b", b[:, 1:])], {"shard_dims": {"b": 1}}),
    ]
    assert state_dcp.shard_dims(shards) == {"a": 0, "b": 1} and state_dcp.shard_dims([([], {})]) is None
    got = export.job_view(shards)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_a_collective_failing_inside_a_stages_forward_is_a_failed_collective():
    """Under pp x tp a TP collective runs inside a stage's forward, and torch's stage re-raises its
    failure as its own RuntimeError ("[Stage 0] failed to run forward") from it: still a failed
    collective (the step is recovered), as is the bare error; an error unrelated to communication
    is not."""
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
        except RuntimeError as e:
            raise RuntimeError("[Stage 0] failed to run forward") from e
    except RuntimeError as wrapped:
        assert is_comm_error(wrapped) and is_comm_error(wrapped.__cause__)
    assert not is_comm_error(RuntimeError("[Stage 0] failed to run forward")) and not is_comm_error(ValueError("gloo"))
