"""Pins every private torch name ckptless_hpc.train.torch_private (and the FSDP binding) touches:
a torch upgrade that renames or removes one fails here, by name, before a sharded run trains
on a stale group. When this fails: read the new torch source for that name, adapt
torch_private.py, re-run tests/unit/test_fsdp_binding.py, then extend SUPPORTED."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist

from ckptless_hpc.train import torch_private as P

pytestmark = pytest.mark.timeout(60)


def test_this_torch_is_supported():
    P.check()


def test_c10d_world_and_process_group_internals():
    c10d = dist.distributed_c10d
    params = inspect.signature(c10d._register_pg_in_world).parameters
    for name in ("pg", "backend_name", "store", "group_name", "backend_config", "rank_mapping"):
        assert name in params, name
    assert callable(c10d._unregister_process_group) and callable(c10d._get_default_group)
    for table in ("pg_map", "pg_names", "pg_backend_config", "pg_group_ranks", "pg_to_tag", "tags_to_pg"):
        assert isinstance(getattr(c10d._world, table), dict), table
    for method in ("_set_default_backend", "_register_backend", "_set_group_name", "_set_group_desc", "_get_backend"):
        assert hasattr(dist.ProcessGroup, method), method
    assert hasattr(dist.ProcessGroup.BackendType, "GLOO") and hasattr(dist.Backend, "_plugins")
    assert hasattr(dist.ProcessGroupGloo, "_Options")


def test_device_mesh_internals():
    from torch.distributed.device_mesh import DeviceMesh

    params = inspect.signature(DeviceMesh.__init__).parameters
    assert "_init_backend" in params and "_rank" in params
    mesh = DeviceMesh("cpu", torch.tensor([3, 5], dtype=torch.int), _init_backend=False, _rank=5)
    assert mesh._pg_registry == {} and mesh._coordinate_on_dim == (1,)
    src = inspect.getsource(DeviceMesh.get_group)
    assert "_dim_group_names" in src and "_get_pg_from_name" in src  # the name re-bind relies on
    assert hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache")
    from torch.distributed.tensor import DTensor

    assert hasattr(DTensor._op_dispatcher, "sharding_propagator")


def test_fsdp2_internals():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_common, _fsdp_param, _fsdp_param_group

    for method in ("_get_fsdp_state", "reset_iter_state", "set_all_reduce_hook", "set_requires_gradient_sync"):
        assert hasattr(FSDPModule, method), method
    fields = {f.name for f in dataclasses.fields(_fsdp_common.FSDPMeshInfo)}
    assert "mesh" in fields
    init = inspect.getsource(_fsdp_common.FSDPMeshInfo.__post_init__)
    assert "self.shard_process_group" in init and "self.reduce_scatter_process_group" in init
    group_src = inspect.getsource(_fsdp_param_group.FSDPParamGroup)
    for attr in ("self.mesh_info", "self.post_forward_mesh_info", "self.fsdp_params", "mesh_info.shard_process_group",
                 "mesh_info.reduce_scatter_process_group", "self._all_reduce_hook"):
        assert attr in group_src, attr
    param_src = inspect.getsource(_fsdp_param.FSDPParam)
    assert "self.mesh_info" in param_src and "self.post_forward_mesh_info" in param_src
    # drop_unsharded_grads: where FSDP accumulates no-sync gradients, and that reset_iter_state leaves them
    assert "self.unsharded_accumulated_grad" in param_src and "self._unsharded_param.grad" in param_src
    assert "unsharded_param.grad = None" not in inspect.getsource(_fsdp_param_group.FSDPParamGroup._reset_iter_state)
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert "_fsdp_param_groups" in inspect.getsource(FSDPState)
    # the HSDP hook runs after the shard group's reduce-scatter, before the post-divide
    reduce_src = inspect.getsource(_fsdp_collectives.foreach_reduce)
    # fp16 GradScaler: DTensor reduces the inf flag over the grads' mesh (public behaviour relied on)
    from torch.distributed.tensor import _dispatch

    assert "Partial(\"max\")" in inspect.getsource(_dispatch.found_inf_reduce_handler)
    assert reduce_src.index("all_reduce_hook(reduce_output)") < reduce_src.index("_div_if_needed(reduce_output, postdivide_factor)")


# ------------------------------------------------------------------ FSDP2 x TP on one 2-D mesh (train/tp.py's TPShardStrategy)
_S, _T = 2, 2  # FSDP shard x TP ranks: rank = s * _T + t


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _batch(step: int, data_rank: int):
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _gen_groups(store, gen: int, rank: int):
    """Generation ``gen``'s TP group (same s) and FSDP shard group (same t), registered."""
    import datetime

    from ckptless_hpc.train import fsdp

    s, t = divmod(rank, _T)
    out = {}
    for dim, kind, ranks in (("tp", f"tp{s}", [s * _T + i for i in range(_T)]), ("dp_shard", f"sh{t}", [i * _T + t for i in range(_S)])):
        backend = dist.ProcessGroupGloo(dist.PrefixStore(f"g{gen}/{kind}", store), ranks.index(rank), len(ranks), datetime.timedelta(seconds=30))
        out[dim] = fsdp.register_group(backend, f"gen{gen}/{kind}", ranks)
    return out


def _two_d_worker(rank: int, port: int, q) -> None:
    import datetime

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ckptless_hpc.train import fsdp

    try:
        store = dist.TCPStore("127.0.0.1", port, _S * _T, rank == 0, timeout=datetime.timedelta(seconds=30))
        fsdp.stable_default_group(rank, _S * _T)
        groups = _gen_groups(store, 0, rank)
        mesh = P.mesh_2d(torch.arange(_S * _T).reshape(_S, _T).tolist(), ("dp_shard", "tp"), rank, "cpu", groups)
        model = _mlp()
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp_shard"]
        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=None)
        fully_shard(model, mesh=dp_mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(4):
            if step == 2:  # generation 1: new groups, the same mesh objects (and FSDP's own) re-pointed
                old, groups = groups, _gen_groups(store, 1, rank)
                # FSDP's per-parameter meshes: _init_sharding_spec_tp's DeviceMesh._concatenate copied the names
                for m in (mesh, tp_mesh, dp_mesh, *P.fsdp_param_meshes(model)):
                    P.point_mesh(m, groups)
                for info in P.mesh_infos(model):
                    P.set_shard_group(info, groups["dp_shard"])
                for pg in old.values():  # generation 0 is gone: a mesh still pointing at it fails
                    P.forget(pg)
                    pg.abort()
            x, y = _batch(step, rank // _T)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        q.put((rank, {n: p.full_tensor().detach().tolist() for n, p in model.named_parameters()}))
    except BaseException as err:  # the parent reports it
        q.put((rank, repr(err)))


@pytest.mark.timeout(120)
def test_fsdp2_over_tensor_parallel_on_one_2d_mesh_of_own_groups_rebinds_to_a_new_generation():
    """FSDP2 over the dp_shard dim of a 2-D (dp_shard, tp) mesh whose dims are this project's
    registered per-generation gloo groups, the model first made tensor-parallel on the tp dim
    (torchtitan's 2-D layout), trains 2 Adam steps, is re-pointed at generation 1's groups
    (the mesh, its two sub-meshes and each FSDPParam's concatenated mesh) and trains 2 more: its
    weights equal the same training in one process (the fact issue 31's dp_shard x tp builds on;
    it fails if torch stops copying the dims' group names into FSDP's meshes, or renames them)."""
    import random

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = random.randint(20000, 60000)
    procs = [ctx.Process(target=_two_d_worker, args=(r, port, q), daemon=True) for r in range(_S * _T)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=100) for _ in procs)
    for p in procs:
        p.join(10)
    errors = {r: v for r, v in got.items() if isinstance(v, str)}
    assert not errors, errors
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):
        opt.zero_grad()
        sum(((model(x) - y) ** 2).mean() / _S for x, y in (_batch(step, s) for s in range(_S))).backward()
        opt.step()
    for rank, weights in got.items():
        for name, p in model.named_parameters():
            torch.testing.assert_close(torch.tensor(weights[name]), p.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


def test_pipeline_stage_internals():
    """train/pp.py's stage overrides ``_forward_metadata_inference`` (the shape inference of a new
    stage's first step) to put back the buffers that run writes: torch must still call it by that
    name from ``_prepare_forward_infra``, or the override is silently skipped."""
    from torch.distributed.pipelining import PipelineStage

    assert callable(getattr(PipelineStage, "_forward_metadata_inference", None))
    assert "self._forward_metadata_inference(" in inspect.getsource(PipelineStage._prepare_forward_infra)
