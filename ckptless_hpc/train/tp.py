"""``parallel=tp``: tensor parallel inside each replica, data parallel across replicas.

The ranks form groups of ``parallel.tp`` consecutive ranks (a *TP group*: one replica of the
model, best on one node); the ranks with the same index in every group (the same *TP
coordinate*) form the replicate group. Both are formed per generation as hsdp's are
(:func:`.fsdp.form_hsdp_groups`: ``comm.hsdp.shard`` is the TP group, ``comm.hsdp.replicate``
the replicate group), and the model is parallelized once, with the task's plan
(``Task.tp_plan(model)``: module name -> ``ColwiseParallel()`` / ``RowwiseParallel()`` / ...,
as torchtitan's ``parallelize_*`` functions give it to ``parallelize_module``), on a 1-D mesh
over the TP group that every later generation re-points at its own group (the same mesh object:
:func:`.torch_private.rebind_mesh`, as FSDP2's binding does).

A step: every rank of a TP group computes the same micro-batches (its data rank is
``rank // tp``) and its DTensor collectives run inside forward and backward; after the last
backward each parameter's local gradient is summed over the replicate group, in buckets of
``train.bucket_mb`` (:meth:`.grouped.LocalState.mean_over_replicas`; a
peer's death raises there: ``StepFailed``), and divided into the mean over the global batch;
then the norm sums the squares of the sharded gradients' local parts over the TP group and adds
the replicated ones once.

State: this rank's local tensors (:func:`.fsdp.own_entries`: a DTensor parameter's local
shard, its optimizer state's, plain tensors whole), and in the metadata the dimension each
sharded parameter is split along (``meta["shard_dims"]``), which the export joins by
(:func:`ckptless_hpc.state.export.job_view`). A lost rank's state is its TP coordinate's, held
by the same coordinate of every other replica: no copy is ever sent (as hsdp).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..config import same_batch
from . import fsdp
from . import torch_private as P
from .fsdp_strategy import FSDPStrategy
from .grouped import LocalState, StepFailed, collectives, form_mesh_groups, is_comm_error


def _shard_dim(t: torch.Tensor) -> Optional[int]:
    """The dimension a DTensor is sharded along over its (1-D) mesh, or None (plain, replicated)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    for pl in t.placements:
        if pl.is_shard():
            return int(pl.dim)  # type: ignore[attr-defined]
        if pl.is_partial():
            raise ValueError(f"a parameter is a Partial DTensor ({t.placements}). HINT: a TP plan shards parameters (Shard) or replicates them")
    return None


def plan_of(task: Any, model: torch.nn.Module) -> Dict[str, Any]:
    """The task's tensor-parallel plan, checked: a mapping of module names to parallel styles."""
    fn = getattr(task, "tp_plan", None)
    if not callable(fn):
        raise ValueError(
            f"parallel=tp needs {type(task).__name__}.tp_plan(model): the module names to shard and how "
            "(e.g. {'mlp.up': ColwiseParallel(), 'mlp.down': RowwiseParallel()}, as torchtitan's parallelize_* give it). "
            "HINT: add tp_plan to the task, or use parallel=fsdp|hsdp"
        )
    plan = fn(model)
    names = dict(model.named_modules())
    unknown = sorted(k for k in plan if k not in names and "*" not in k)
    if not plan or unknown:
        raise ValueError(f"{type(task).__name__}.tp_plan names no module of the model: {unknown or 'an empty plan'}. HINT: names as model.named_modules() gives them")
    return dict(plan)


def tp_mesh(tp_group: Any, rank: int, device: torch.device) -> Any:
    """A 1-D DeviceMesh over the generation's TP group (re-pointed at each later generation's:
    :func:`.torch_private.rebind_mesh`)."""
    return P.mesh_of(tp_group, dist.get_process_group_ranks(tp_group), rank, device.type)


def parallelize(task: Any, model: torch.nn.Module, mesh: Any) -> Dict[str, int]:
    """``model`` parallelized in place on the 1-D TP ``mesh`` with the task's plan; the dimension
    each sharded parameter is split along (what the export joins the TP shards along)."""
    from torch.distributed.tensor.parallel import parallelize_module

    # src_data_rank=None: each rank keeps its own slice of the model it built (the same seeded
    # model everywhere) instead of a scatter from the group's first rank: a spare joining a
    # group of survivors, who parallelized long ago, would wait on that scatter forever
    parallelize_module(model, mesh, plan_of(task, model), src_data_rank=None)
    return {n: d for n, p in model.named_parameters() if (d := _shard_dim(p)) is not None}


def sharded_squares(model: torch.nn.Module, tp_group: Any, shard_dims: Dict[str, int], shard_group: Any = None) -> torch.Tensor:
    """The squared L2 norm of a TP group's gradients: the TP-sharded gradients' (``shard_dims``)
    local squares summed over ``tp_group`` (a collective), the replicated ones' added once (every
    rank holds them whole). tp x shard: both first summed over ``shard_group``, whose ranks each
    hold FSDP2's dim-0 shard of them."""
    sq = fsdp.local_squares(model, shard_dims)
    if shard_group is not None:
        dist.all_reduce(sq, group=shard_group)
    sharded = sq[0].clone()
    dist.all_reduce(sharded, group=tp_group)
    return sharded + sq[1]


class TPStrategy(LocalState):
    """``parallel=tp`` (train/strategy.py; what it shares with fsdp and pp: train/grouped.py)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.tp = int(engine.cfg.parallel.tp)
        self.same_batch = same_batch(engine.cfg.parallel)  # the ranks of a TP group compute the same batch
        self.replica_size = self.tp
        self.mesh: Any = None
        self.tp_group: Any = None
        self.rep_group: Any = None
        self.shard_dims: Dict[str, int] = {}

    @property
    def ready(self) -> bool:
        return self.mesh is not None

    def meta_extra(self) -> Dict[str, Any]:
        return {"shard_dims": dict(self.shard_dims)}  # what the export joins the TP shards along

    # ------------------------------------------------------------------ generations (parallelized, and given its optimizer, at the first bind)
    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None:
        """The generation's TP and replicate groups (train/fsdp.py's hsdp groups), as ``comm.hsdp``."""
        e = self.e
        comm.hsdp = fsdp.form_hsdp_groups(store, comm.gen, comm.rank, comm.world, self.tp, host, timeout_s, e.device, comm.backend)

    def let_go(self, comm: Any) -> bool:
        """The generation's groups are destroyed at once, in a thread (a peer blocked in one
        that did not fail here is released only then), after the mesh lets go of them."""
        if self.mesh is not None:
            P.unbind_mesh(self.mesh)
        self.tp_group = self.rep_group = None
        return self.release_groups(comm, [])

    def bind(self, comm: Any) -> None:
        """The first generation: the model parallelized on a mesh over the TP group, then the
        optimizer and scheduler built over its DTensor parameters; a later one: the same mesh
        re-pointed at the new TP group."""
        e = self.e
        hs = comm.hsdp
        self.tp_group, self.rep_group = hs.shard, hs.replicate
        if self.mesh is not None:
            P.rebind_mesh(self.mesh, self.tp_group)
            return
        fsdp.stable_default_group(comm.rank, comm.world)
        self.mesh = tp_mesh(self.tp_group, comm.rank, e.device)
        self.shard_dims = parallelize(e.task, e.model, self.mesh)
        self.build_optimizer()

    # ------------------------------------------------------------------ one step
    def forward_backward(self, step: int, comm: Any, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> Optional[torch.Tensor]:
        """Forwards and backwards (the DTensor collectives inside), then the gradients summed over
        the replicas and the step's one all-reduce (the loss, the buffers' flag, the norm:
        grouped.py), rank 0's buffers broadcast over the generation's group where written."""
        e = self.e
        e.optimizer.zero_grad(set_to_none=True)
        with collectives(f"step {step}"):
            for micro in range(e.micro_batches):
                batch = e.feed.get(step, micro)
                e.seed(step, comm.rank, micro)
                with e.autocast():
                    loss = e.task_loss(batch)
                e.add_loss(loss)
                loss.backward()
            on_backward()
            return self.reduce_and_norm(comm, wait, comm)


class TPShardStrategy(FSDPStrategy):
    """``parallel=tp`` with ``parallel.shard_size=S`` > 1 (tp x shard, torchtitan's 2-D layout
    ``dp_shard x tp``): a replica is ``S`` TP groups of ``T`` ranks, rank ``r*S*T + s*T + t``
    (:func:`.grouped.mesh_coordinate`); the generation's groups are the TP group (same replica
    and shard), the FSDP shard group (same replica and TP rank) and the replicate group (same
    coordinate in every replica), :func:`.grouped.form_mesh_groups`. At the first bind the
    model is made tensor parallel with the task's plan on the ``tp`` dim of a 2-D mesh
    (``dp_shard``, ``tp``) over the replica, then FSDP2-sharded (fsdp.py's binding: the task's
    units, then the root) on its ``dp_shard`` dim, with HSDP's cross-replica mean where there are
    replicas; every later generation points the same meshes (the 2-D mesh, its two slices and
    the meshes FSDP2 concatenated from them for each parameter) at its own groups.

    The step is FSDP2's (fsdp_strategy.py): its all-gathers and reduce-scatters on the dp_shard
    dim, the DTensor collectives on the tp dim; a TP group computes the same micro-batches (data
    rank ``rank // T``). The norm: the squares of each rank's local pieces summed over the shard
    group, the TP-sharded ones' then over the TP group. State: this rank's local tensors (FSDP2's
    dim-0 shard of its TP shard) and, in the metadata, the TP dimension of each sharded
    parameter and the number of FSDP2 shards (what the export joins by: state/dcp.py ``join``)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        p = engine.cfg.parallel
        self.tp, self.n_shards = int(p.tp), int(p.shard_size)
        self.same_batch = same_batch(engine.cfg.parallel)  # the ranks of a TP group compute the same batch
        self.mesh: Any = None
        self.tp_mesh: Any = None
        self.tp_group: Any = None
        self.shard_group: Any = None
        self.shard_dims: Dict[str, int] = {}

    def meta_extra(self) -> Dict[str, Any]:
        return {"shard_dims": dict(self.shard_dims), "fsdp_shards": self.n_shards}

    def warm_up(self) -> None:
        return None  # the spare's first fully_shard runs over a TP-parallel model on the generation's mesh

    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None:
        """The generation's TP, FSDP shard and replicate groups, as ``comm.hsdp``."""
        comm.hsdp = form_mesh_groups(store, comm, self.n_shards, self.tp, host, timeout_s, self.e.device, outer="sh")

    def meshes(self) -> List[Any]:
        """Every mesh the model's DTensors and hooks hold: the 2-D mesh, its tp slice (the TP
        plan's), and FSDP2's (its dp_shard slice is the binding's, among them)."""
        return [self.mesh, self.tp_mesh, *P.fsdp_param_meshes(self.e.model)] if self.mesh is not None else []

    def bind(self, comm: Any) -> None:
        e = self.e
        hs = comm.hsdp
        groups = {"dp_shard": hs.shard, "tp": hs.tp}
        rep = hs.replicate if e.world > self.n_shards * self.tp else None  # one replica: no cross-replica mean
        self.tp_group, self.shard_group = hs.tp, hs.shard
        if self.binding is not None:
            for m in self.meshes():
                P.point_mesh(m, groups)
            self.binding.rebind(hs.shard, rep)
            return
        fsdp.stable_default_group(comm.rank, comm.world)
        size = self.n_shards * self.tp
        base = comm.rank // size * size
        self.mesh = P.mesh_2d([[base + s * self.tp + t for t in range(self.tp)] for s in range(self.n_shards)], ("dp_shard", "tp"), comm.rank, e.device.type, groups)
        self.tp_mesh = self.mesh["tp"]
        self.shard_dims = parallelize(e.task, e.model, self.tp_mesh)
        units = fsdp.units_for(e.task, e.model)
        self.binding = fsdp.FSDPBinding.shard(e.model, hs.shard, rep, units=units, rank=comm.rank, mesh=self.mesh["dp_shard"], **self.shard_kwargs())
        self.build_optimizer()

    def let_go(self, comm: Any) -> bool:
        for m in self.meshes():
            P.unbind_mesh(m)
        self.tp_group = self.shard_group = None
        return super().let_go(comm)

    def _collective_norm(self) -> torch.Tensor:
        try:
            return sharded_squares(self.e.model, self.tp_group, self.shard_dims, self.shard_group).sqrt()
        except Exception as err:
            if is_comm_error(err):
                raise StepFailed(f"gradient norm: {err}") from None
            raise
