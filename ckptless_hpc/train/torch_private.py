"""Every access to torch's private distributed internals, in one place.

FSDP2, DeviceMesh and c10d's group registry offer no public way to (1) register a process group
that was built directly (a generation's ``ProcessGroupGloo`` on a prefixed store), (2) point an
existing mesh and FSDP's groups at another generation's group without rebuilding the model, or
(3) build a mesh before this process has a rank (a hot spare's warm-up). What is used here was
read in the source of torch 2.13 and is pinned by tests/unit/test_torch_private.py: an upgrade
of torch fails that test (and :func:`check` refuses an unknown version at first use), instead of
training silently on a stale group.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

SUPPORTED = ("2.13",)  # major.minor of the torch builds whose internals this module was written against


def check() -> None:
    """Refuse a torch whose internals were not checked (called at first use, not at import: the
    replicated strategy must keep working on any torch the package allows)."""
    version = torch.__version__.split("+")[0]
    if ".".join(version.split(".")[:2]) not in SUPPORTED:
        raise RuntimeError(
            f"ckptless_hpc's FSDP2/HSDP binding touches private torch internals checked only on torch {', '.join(SUPPORTED)}.x; "
            f"this is torch {torch.__version__}. HINT: install torch=={SUPPORTED[-1]}.* (parallel=ddp works on any), or re-check "
            "ckptless_hpc/train/torch_private.py against the new source and extend SUPPORTED (tests/unit/test_torch_private.py pins it)"
        )


# ---------------------------------------------------------------------------------- c10d world
def backend_type(backend: object) -> "dist.ProcessGroup.BackendType":
    if isinstance(backend, dist.ProcessGroupGloo):
        return dist.ProcessGroup.BackendType.GLOO
    if dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL):
        return dist.ProcessGroup.BackendType.NCCL
    raise TypeError(f"cannot wrap a {type(backend).__name__} as a process group. HINT: pass a ProcessGroupGloo or ProcessGroupNCCL")


def wrap_backend(backend: object, name: str, global_ranks: Sequence[int], store: object) -> dist.ProcessGroup:
    """A ``ProcessGroup`` over ``backend`` (group rank = the backend's rank), named ``name`` and
    registered in c10d's world with the global rank -> group rank mapping, as ``new_group`` does."""
    btype = backend_type(backend)
    device = torch.device("cpu" if btype == dist.ProcessGroup.BackendType.GLOO else "cuda")
    pg = dist.ProcessGroup(store, backend.rank(), backend.size())  # type: ignore[attr-defined]
    pg._set_default_backend(btype)
    pg._register_backend(device, btype, backend)
    pg._set_group_name(name)
    pg._set_group_desc(name)
    kind = "gloo" if btype == dist.ProcessGroup.BackendType.GLOO else "nccl"
    dist.distributed_c10d._register_pg_in_world(
        pg,
        backend_name=kind,
        store=store,
        group_name=name,
        backend_config=f"{device.type}:{kind}",
        rank_mapping={int(g): i for i, g in enumerate(global_ranks)},
    )
    return pg


def forget(pg: dist.ProcessGroup) -> None:
    """Drop ``pg`` from c10d's world without touching its backend (destroying a group stuck on a
    dead peer blocks: the caller's Retired releases the backend later)."""
    w = dist.distributed_c10d._world
    name = w.pg_names.pop(pg, None)
    for table in (w.pg_map, w.pg_backend_config, w.pg_group_ranks, w.pg_to_tag):
        table.pop(pg, None)
    for pgs in w.tags_to_pg.values():
        while pg in pgs:
            pgs.remove(pg)
    if name is not None:
        dist.distributed_c10d._unregister_process_group(name)


def is_registered_pg(pg: dist.ProcessGroup) -> bool:
    return pg in dist.distributed_c10d._world.pg_names


def registered(name: str) -> bool:
    return name in dist.distributed_c10d._world.pg_names.values()


# ---------------------------------------------------------------------------------- DeviceMesh
def mesh_of(pg: dist.ProcessGroup, global_ranks: Sequence[int], my_rank: int, device_type: str, dim_name: Optional[str] = None) -> object:
    """A 1-D DeviceMesh over ``pg`` that never asks the default group (``DeviceMesh.from_group``
    does, for the rank): also usable by a spare that has no rank yet. Mesh equality (and so
    DTensor's caches) ignores the group: ``dim_name`` keeps a throwaway mesh apart from real ones."""
    from torch.distributed.device_mesh import DeviceMesh

    names = (dim_name,) if dim_name else None
    mesh = DeviceMesh(device_type, torch.tensor(list(global_ranks), dtype=torch.int), mesh_dim_names=names, _init_backend=False, _rank=int(my_rank))
    rebind_mesh(mesh, pg)
    return mesh


def rebind_mesh(mesh: object, pg: dist.ProcessGroup) -> None:
    """Point the SAME 1-D mesh object at ``pg`` (its ``get_group()`` resolves the name): DTensor
    caches keyed by the mesh's structure stay valid, so ``full_tensor()`` and friends follow."""
    mesh._dim_group_names = [pg.group_name]  # type: ignore[attr-defined]
    mesh._pg_registry = {pg.group_name: pg}  # type: ignore[attr-defined]


def mesh_2d(ranks: Sequence[Sequence[int]], dim_names: Sequence[str], my_rank: int, device_type: str, groups: Dict[str, dist.ProcessGroup]) -> object:
    """A 2-D DeviceMesh of ``ranks`` (rows x columns) whose dims are ``dim_names``, each pointed
    at the group of its name in ``groups`` (:func:`point_mesh`); as :func:`mesh_of`, it never
    asks the default group."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device_type, torch.tensor(ranks, dtype=torch.int), mesh_dim_names=tuple(dim_names), _init_backend=False, _rank=int(my_rank))
    point_mesh(mesh, groups)
    return mesh


def point_mesh(mesh: object, groups: Dict[str, dist.ProcessGroup]) -> None:
    """Point the SAME named mesh (any number of dims: a 2-D mesh, a slice of it, FSDP2's meshes
    concatenated from slices) at the groups of its dims' names (as :func:`rebind_mesh`)."""
    names = mesh.mesh_dim_names  # type: ignore[attr-defined]
    mesh._dim_group_names = [groups[n].group_name for n in names]  # type: ignore[attr-defined]
    mesh._pg_registry = {groups[n].group_name: groups[n] for n in names}  # type: ignore[attr-defined]


def unbind_mesh(mesh: object) -> None:
    mesh._dim_group_names = ["<unbound: between generations>"] * mesh.ndim  # type: ignore[attr-defined]
    mesh._pg_registry = {}  # type: ignore[attr-defined]


def mesh_ranks(mesh: object) -> List[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]  # type: ignore[attr-defined]


def clear_dtensor_caches() -> None:
    """DTensor's sharding-propagation caches (C++ fast path and Python LRU), keyed by meshes."""
    from torch.distributed.tensor import DTensor

    torch._C._clear_DTensor_sharding_propagator_cache()
    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding",):
        fn = getattr(prop, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


# ---------------------------------------------------------------------------------- FSDP2 states
def fsdp_states(model: torch.nn.Module) -> Iterator[object]:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            yield m._get_fsdp_state()


def param_groups(model: torch.nn.Module) -> Iterator[object]:
    for state in fsdp_states(model):
        yield from state._fsdp_param_groups  # type: ignore[attr-defined]


def mesh_infos(model: torch.nn.Module) -> List[object]:
    """Every distinct mesh info FSDP holds (per param group and per parameter)."""
    seen: Dict[int, object] = {}
    for group in param_groups(model):
        for info in (group.mesh_info, group.post_forward_mesh_info):  # type: ignore[attr-defined]
            if info is not None:
                seen[id(info)] = info
        for fp in group.fsdp_params:  # type: ignore[attr-defined]
            for info in (fp.mesh_info, fp.post_forward_mesh_info):
                if info is not None:
                    seen[id(info)] = info
    return list(seen.values())


def fsdp_param_meshes(model: torch.nn.Module) -> List[object]:
    """The meshes FSDP2 made for its parameters over a TP-parallel model: each FSDPParam's SPMD
    mesh and its sharding spec's (``_init_sharding_spec``'s ``DeviceMesh._concatenate`` of the
    dp_shard and tp slices, which copied their group names); distinct objects."""
    seen: Dict[int, object] = {}
    for group in param_groups(model):
        for fp in group.fsdp_params:  # type: ignore[attr-defined]
            for m in (getattr(fp, "_spmd_mesh", None), getattr(getattr(fp, "_sharding_spec", None), "mesh", None)):
                if m is not None:
                    seen[id(m)] = m
    return list(seen.values())


def drop_unsharded_grads(model: torch.nn.Module) -> int:
    """Drop the gradients FSDP accumulates on the unsharded parameters between the micro-batches
    of a step (``set_requires_gradient_sync(False)``): ``reset_iter_state()`` in torch 2.13
    discards the reduce-scatter state but leaves these, so a step redone after a failure in its
    last micro-batch would add the failed attempt's earlier micro-batches again. Returns how many
    were dropped."""
    n = 0
    for group in param_groups(model):
        for fp in group.fsdp_params:  # type: ignore[attr-defined]
            if fp.unsharded_accumulated_grad is not None:
                fp.unsharded_accumulated_grad = None
                n += 1
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                unsharded.grad = None
                n += 1
    return n


def set_shard_group(info: object, pg: dist.ProcessGroup) -> None:
    """FSDP's all-gathers and reduce-scatters read these at each call."""
    info.shard_process_group = pg  # type: ignore[attr-defined]
    info.reduce_scatter_process_group = None  # type: ignore[attr-defined]  # never a separate one


def info_mesh(info: object) -> object:
    return info.mesh  # type: ignore[attr-defined]


def post_forward_meshes(model: torch.nn.Module) -> int:
    return sum(1 for g in param_groups(model) if g.post_forward_mesh_info is not None)  # type: ignore[attr-defined]
