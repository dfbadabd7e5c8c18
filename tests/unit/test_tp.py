"""parallel=tp without processes: the config's checks, the task's plan checked, where each rank's
shard comes from, the data each rank trains on, and the export joining TP shards along the
dimension each parameter is split on (the end-to-end proof: tests/e2e/test_zoo.py, tp-llama_tp)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from torch import nn

from ckptless_hpc.config import data_world, global_batch, register_configs, resume_shards, validation_errors
from ckptless_hpc.coordinator.sharding import Layout
from ckptless_hpc.launch.probes import PROBES
from ckptless_hpc.state import dcp as state_dcp
from ckptless_hpc.state import export
from ckptless_hpc.state.views import UserView, model_tensors
from ckptless_hpc.train.tp import plan_of
from models.llama import LlamaTask, LlamaTPTask

pytestmark = pytest.mark.timeout(60)
register_configs()


def cfg(*overrides: str):
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        return compose(config_name="config", overrides=["task=mlp", *overrides])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (("parallel=tp", "parallel.tp=3", "cluster.workers_per_node=2"), "parallel.tp=3: tp needs a tensor-parallel group size that divides the world size 4"),
        (("parallel=tp", "parallel.tp=4", "cluster.nodes=1", "cluster.workers_per_node=4"), "replication.factor=1: parallel.tp=4 makes the whole world one replica"),
        (("parallel=tp", "parallel.tp=2", "cluster.workers_per_node=1", "replication.factor=0"), "replication.factor=0: parallel.tp=2 makes the whole world one replica"),
        (("parallel=tp", "parallel.tp=2", "cluster.nodes=1", "cluster.workers_per_node=4"), "parallel.tp=2: every replica of some shard lives on one node"),
        (("parallel=tp", "cluster.workers_per_node=2", "parallel.param_dtype=bf16"), "FSDP2's MixedPrecisionPolicy is for parallel=fsdp|hsdp and tp x shard (parallel.shard_size > 1), not tp alone"),
        (("parallel=tp", "cluster.workers_per_node=2", "cluster.nodes=3", "cluster.min_nodes=2"), "parallel.mode=tp cannot shrink yet"),
    ],
)
def test_a_tp_layout_that_cannot_work_is_refused_naming_the_field(overrides, needle):
    errors = validation_errors(cfg(*overrides), PROBES)
    assert any(needle in e and "HINT" in e for e in errors), errors


def test_the_layout_replicas_hold_the_same_coordinate_and_one_data_rank_per_group():
    c = cfg("parallel=tp", "parallel.tp=2", "cluster.nodes=3", "cluster.workers_per_node=2")
    assert validation_errors(c, PROBES) == []
    lay = Layout(c)
    assert lay.shard_of == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1} and lay.shards == 2 and lay.factor == 0
    assert lay.survives() == 2 and "tensor parallel in groups of 2, 3 replicas" in lay.describe()
    assert data_world(c) == 3 and "x world 3" in global_batch(c, 4) and resume_shards(c) == 2


def test_one_replica_copies_each_ranks_shard_to_another_node():
    c = cfg("parallel=tp", "parallel.tp=2", "cluster.nodes=2", "cluster.workers_per_node=1")
    assert validation_errors(c, PROBES) == []
    lay = Layout(c)
    assert lay.factor == 1 and lay.place({0: "n0", 1: "n1"}) == {0: [1], 1: [0]} and lay.survives() == 1
    assert "1 copy of each rank's shard on other nodes" in lay.describe() and data_world(c) == 1


def test_a_task_without_a_plan_or_with_a_wrong_one_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"parallel=tp needs LlamaTask.tp_plan\(model\).*HINT"):
        plan_of(LlamaTask(), LlamaTask().build_model())

    class Typo(LlamaTPTask):
        def tp_plan(self, model):
            return {"layers.0.attn.wq": None}

    with pytest.raises(ValueError, match=r"names no module of the model: \['layers.0.attn.wq'\].*HINT"):
        plan_of(Typo(), Typo().build_model())
    task = LlamaTPTask()
    assert set(plan_of(task, task.build_model())) >= {"layers.0.attention.wq", "layers.1.feed_forward.w2"}


def _tp_shards(model: nn.Module, tp: int, dims: dict, opt: torch.optim.Optimizer, fsdp: int = 1):
    """What the ranks of one replica save (train/tp.py collect): each sharded parameter's and its
    optimizer state's local slice along its dim, the rest whole; ``shard_dims`` in the metadata.
    ``fsdp`` > 1 (tp x shard): rank ``s*tp + t`` holds FSDP2's dim-0 chunk ``s`` of TP rank
    ``t``'s part (every tensor's, TP-sharded or not), and the metadata says ``fsdp_shards``."""
    names = {id(p): n for n, p in model.named_parameters()}
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    groups = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    view = UserView.of(model).to_json([n for n, _ in model_tensors(model)])
    out = []
    for r in range(fsdp * tp):
        s, t = divmod(r, tp)

        def mine(n, v, s=s, t=t):
            if v.dim() == 0:
                return v
            part = v.chunk(tp, dim=dims[n])[t] if n in dims else v
            return torch.tensor_split(part, fsdp)[s] if fsdp > 1 else part  # uneven pieces (FSDP2 cuts by torch.chunk: the join concatenates in order either way)

        entries = [(f"param/{n}", mine(n, p.detach())) for n, p in model.named_parameters()]
        entries += [(f"buffer/{n}", b) for n, b in model.named_buffers()]
        for p, st in opt.state.items():
            entries += [(f"optim/{names[id(p)]}/{k}", mine(names[id(p)], v)) for k, v in sorted(st.items())]
        meta = {"step": 2, "hyper": hyper, "groups": groups, "shard_dims": dims, "user_view": view}
        out.append((entries, {**meta, "fsdp_shards": fsdp} if fsdp > 1 else meta))
    return out


@pytest.mark.parametrize("fsdp", [1, 2, 3])
def test_tp_shards_join_along_their_dims_into_the_model_and_its_optimizer(fsdp):
    """tp (fsdp=1) and tp x shard (FSDP2 over 2 or 3 TP groups: uneven dim-0 chunks too)."""
    task = LlamaTPTask()
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        task.loss(model, task.batch(s, 0, 1, torch.Generator().manual_seed(s))).backward()
        opt.step()
        opt.zero_grad()
    plan = task.tp_plan(model)
    dims = {f"{m}.weight": (0 if type(style).__name__ == "ColwiseParallel" else 1) for m, style in plan.items()}
    shards = _tp_shards(model, 2, dims, opt, fsdp)
    got = export.full_model(shards)
    want = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    flat = export.full_model([(e, {**m, "shard_dims": None}) for e, m in shards])  # read as FSDP's dim-0 shards: wrong
    assert not all(torch.equal(flat[k], want[k]) for k in want)
    merged = state_dcp.optimizer_state(shards)["state"]
    for n, p in model.named_parameters():
        assert all(torch.equal(merged[n][k], v) for k, v in opt.state[p].items()), n


def test_a_tp_x_shard_layout_is_s_tp_groups_per_replica_each_coordinate_held_by_every_replica():
    c = cfg("parallel=tp", "parallel.tp=2", "parallel.shard_size=2", "cluster.nodes=2", "cluster.workers_per_node=4")
    assert validation_errors(c, PROBES) == []
    lay = Layout(c)
    assert lay.shard_of == {r: r % 4 for r in range(8)} and lay.shards == 4 and lay.factor == 0 and lay.survives() == 1
    assert "FSDP2 over 2 x tensor parallel 2, 2 replicas of each (shard, TP rank)'s shard" in lay.describe()
    assert data_world(c) == 4 and "x world 4" in global_batch(c, 4) and resume_shards(c) == 4  # a TP group shares a batch; FSDP's shards do not
    one = cfg("parallel=tp", "parallel.tp=2", "parallel.shard_size=2", "cluster.nodes=2", "cluster.workers_per_node=2")
    assert validation_errors(one, PROBES) == [] and Layout(one).factor == 1 and data_world(one) == 2  # one replica: copies on the other node
    from ckptless_hpc.launch.dryrun import placement

    lines = placement(c)
    assert "mesh: 2 replica(s) x dp_shard 2 x tp 2 (replica r, FSDP shard s, TP rank t = rank r*4+s*2+t)" in lines
    assert "  replica 1: s0t0=rank 4@local1, s0t1=rank 5@local1, s1t0=rank 6@local1, s1t1=rank 7@local1" in lines


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (("parallel.shard_size=3",), "parallel.shard_size x parallel.tp=6: tp x shard needs a replica (shard_size x tp ranks) that divides the world size 8"),
        (("parallel.shard_size=0",), "parallel.shard_size=0: must be null or an integer >= 1"),
        (("cluster.nodes=1", "cluster.workers_per_node=8"), "every replica of some shard lives on one node"),
    ],
)
def test_a_tp_x_shard_layout_that_cannot_work_is_refused_naming_the_field(overrides, needle):
    c = cfg("parallel=tp", "parallel.tp=2", "parallel.shard_size=2", "cluster.nodes=2", "cluster.workers_per_node=4", *overrides)
    errors = validation_errors(c, PROBES)
    assert any(needle in e and "HINT" in e for e in errors), errors


def test_fsdp_inside_pipeline_stages_lays_a_replica_out_as_pipelines_and_prints_it():
    """pp x shard: a replica is shard_size pipelines of pp consecutive ranks (rank r*P*S + d*P + s),
    each pipeline a data rank of its own, FSDP2 over the same stage of every pipeline."""
    from ckptless_hpc.config import data_world, group_size, same_batch
    from ckptless_hpc.launch.dryrun import placement

    c = cfg("parallel=pp", "parallel.pp=2", "parallel.shard_size=2", "cluster.nodes=2", "cluster.workers_per_node=4")
    assert validation_errors(c, PROBES) == []
    assert (group_size(c.parallel), same_batch(c.parallel), data_world(c)) == (4, 2, 4)
    lines = placement(c)
    assert "mesh: 2 replica(s) x dp_shard 2 x pp 2 (replica r, FSDP shard d (a pipeline), stage s = rank r*4+d*2+s)" in lines
    assert "  replica 1: d0s0=rank 4@local1, d0s1=rank 5@local1, d1s0=rank 6@local1, d1s1=rank 7@local1" in lines
    assert any("FSDP2 over 2 pipelines of 2 stages" in x for x in lines), lines


def test_all_four_dims_lay_a_pipeline_of_tp_groups_out_as_one_fsdp_rank():
    """replicas x pp x shard x tp: rank r*S*P*T + d*P*T + s*T + t; a pipeline of TP groups (P*T
    consecutive ranks) computes one batch, FSDP2 over the same (stage, TP rank) of each pipeline."""
    from ckptless_hpc.config import data_world, group_size, same_batch
    from ckptless_hpc.launch.dryrun import placement

    c = cfg("parallel=pp", "parallel.pp=2", "parallel.shard_size=2", "parallel.tp=2", "cluster.nodes=2", "cluster.workers_per_node=8")
    assert validation_errors(c, PROBES) == []
    assert (group_size(c.parallel), same_batch(c.parallel), data_world(c)) == (8, 4, 4)
    lines = placement(c)
    assert "mesh: 2 replica(s) x dp_shard 2 x pp 2 x tp 2 (replica r, FSDP shard d (a pipeline), stage s, TP rank t = rank r*8+d*4+s*2+t)" in lines
    assert "  replica 1: d0s0t0=rank 8@local1, d0s0t1=rank 9@local1, d0s1t0=rank 10@local1, d0s1t1=rank 11@local1, d1s0t0=rank 12@local1, d1s0t1=rank 13@local1, d1s1t0=rank 14@local1, d1s1t1=rank 15@local1" in lines


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (("parallel.tp=2", "cluster.workers_per_node=6"), "parallel.pp x parallel.shard_size x parallel.tp=8: pp x shard needs a replica (pp x shard_size x tp ranks) that divides the world size 12"),
        (("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2", "train.grad_accum=4"), "parallel.pp_virtual=2: pp x shard runs one stage per rank"),
        (("parallel.shard_size=3",), "parallel.pp x parallel.shard_size=6: pp x shard needs a replica (pp x shard_size ranks) that divides the world size 8"),
    ],
)
def test_a_pp_x_shard_layout_that_cannot_work_is_refused_naming_the_field(overrides, needle):
    c = cfg("parallel=pp", "parallel.pp=2", "parallel.shard_size=2", "cluster.nodes=2", "cluster.workers_per_node=4", *overrides)
    errors = validation_errors(c, PROBES)
    assert any(needle in e and "HINT" in e for e in errors), errors


def test_the_dry_run_prints_the_mesh_and_where_each_coordinate_lives():
    from ckptless_hpc.launch.dryrun import placement

    lines = placement(cfg("parallel=tp", "parallel.tp=2", "cluster.nodes=3", "cluster.workers_per_node=2"))
    assert "mesh: 3 replica(s) x tp 2 (replica r, TP coordinate c = rank r*2+c)" in lines
    assert "  replica 1: c0=rank 2@local1, c1=rank 3@local1" in lines
    assert "  TP coordinate 1: held by 3 replica(s) on 3 node(s) (local0, local1, local2)" in lines
    assert any("survives 2 simultaneous node losses" in x for x in lines)


def test_the_built_in_lm_task_has_megatrons_mlp_plan():
    from ckptless_hpc.tasks.lm import LMTask

    task = LMTask(d_model=32, n_layers=2, n_heads=2, seq_len=16, batch_size=2)
    plan = plan_of(task, task.build_model())
    assert {k: type(v).__name__ for k, v in plan.items()} == {
        "blocks.0.fc1": "ColwiseParallel",
        "blocks.0.fc2": "RowwiseParallel",
        "blocks.1.fc1": "ColwiseParallel",
        "blocks.1.fc2": "RowwiseParallel",
    }


def test_the_replicate_reduction_buckets_consecutive_gradients_of_one_dtype_up_to_bucket_mb():
    from ckptless_hpc.train.grouped import gradient_buckets

    g = [torch.zeros(10), torch.zeros(10), torch.zeros(100), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), torch.zeros(2)]
    sizes = lambda limit: [[t.numel() for t in b] for b in gradient_buckets(g, limit)]  # noqa: E731
    assert sizes(80) == [[10, 10], [100], [3, 3], [2]]  # 400 bytes > 80: alone
    assert sizes(1 << 20) == [[10, 10, 100], [3, 3], [2]]  # a dtype change starts a bucket


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norms_local_squares_are_the_per_gradient_float64_sums_bit_for_bit(dtype):
    """train/fsdp.py local_squares (one _foreach_norm, the squares added as Python floats) against
    the per-gradient float64 tensor sums it replaced: the same bits, so the clip is the same."""
    from ckptless_hpc.train.fsdp import local_squares

    task = LlamaTPTask()
    torch.manual_seed(0)
    model = task.build_model().to(dtype)
    task.loss(model, task.batch(0, 0, 1, torch.Generator().manual_seed(0))).backward()
    dims = {f"{m}.weight": 0 for m in task.tp_plan(model)}
    want = torch.zeros(2, dtype=torch.float64)
    for n, p in model.named_parameters():
        want[0 if n in dims else 1] += torch.linalg.vector_norm(p.grad, 2, dtype=torch.float64).pow(2)
    got = local_squares(model, dims)
    assert got.view(torch.int64).tolist() == want.view(torch.int64).tolist(), (got.tolist(), want.tolist())
