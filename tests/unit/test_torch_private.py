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
