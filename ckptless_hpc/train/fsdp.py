"""FSDP2 and HSDP on per-generation groups: shard once, re-bind at every generation.

A generation's group is a raw backend (``Communicator.form``). :func:`register_group` makes it a
``ProcessGroup`` that DeviceMesh and FSDP2 accept; :class:`FSDPBinding` applies ``fully_shard``
once and, at each new generation, points the same mesh and every FSDP parameter group at the new
group (:meth:`FSDPBinding.rebind`, ~0.1 ms: no model rebuild, no second copy of the state).

HSDP is done the cheap way (as torchft does): FSDP2 shards over the shard group only (the ranks
of one replica), and an all-reduce hook averages each reduce-scattered gradient shard over the
replicate group (the same shard index in every replica). Swapping the replicate group is one
attribute; FSDP never sees it. Layout: ``replica = rank // shard_size``,
``shard_index = rank % shard_size`` (:func:`hsdp_layout`).

State moves peer to peer outside torch.distributed: :func:`own_entries` and :func:`load_own`
give and take this rank's local shards as named tensors, without a collective.

How an engine uses it (every private torch access is in :mod:`.torch_private`):

once per process, when it has its rank::

    stable_default_group(rank, world)
    model = task.build_model()                      # same seed everywhere
    pg = register_group(comm)                       # FSDP: the generation's group "gen<g>"
    # HSDP: hs = form_hsdp_groups(store, g, rank, world, shard_size, host, timeout_s); pg = hs.shard
    binding = FSDPBinding.shard(model, pg, hs.replicate if hsdp else None, units=units_for(task, model))
    optimizer = task.build_optimizer(model, ...)    # AFTER shard: on the DTensor parameters

a hot spare, before it has a rank: ``warm_up(task.build_model, loss_of_a_batch, optimizer_factory)``;
when promoted: the lines above, then ``load_own(model, optimizer, entries_from_a_holder)``.

one step (K micro-batches)::

    optimizer.zero_grad(set_to_none=True)
    for k in range(K):
        binding.set_sync(k == K - 1)                # no reduction before the last micro-batch
        (loss_k / K).backward()                     # FSDP all-gathers / reduce-scatters inside
    binding.clip(max_norm)                          # or binding.grad_norm(): on the generation's group
    optimizer.step()                                # committed; own_entries(model, optimizer) -> replicas

a failed step (gloo raised in forward/backward, or the coordinator said abort)::

    binding.reset()                                 # reset_iter_state() + drop gradients
    <put back buffers the failed forward changed; undo snapshot if the optimizer had stepped>
    release_in_background(binding.unbind() + <this generation's pgs and comms>)   # releases peers
    <form generation g+1>; binding.rebind(new_pg, new_replicate_pg); redo the step
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import torch_private as P
from .comm import Communicator

Entries = List[Tuple[str, torch.Tensor]]
IDENTITY_BACKEND = "ckptless_identity"


# ------------------------------------------------------------------ the default group
class _IdentityGroup(dist.ProcessGroup):
    """The default group: it only says this process's rank (DeviceMesh and DTensor ask
    ``dist.get_rank()``); every collective on it is refused."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return IDENTITY_BACKEND

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a collective was issued on the default process group, which ckptless_hpc keeps for the rank only "
            "(each generation has its own group). HINT: pass group=<the generation's group> (FSDPBinding.group)"
        )

    allreduce = allreduce_coalesced = broadcast = barrier = allgather = allgather_coalesced = _refuse
    allgather_into_tensor_coalesced = reduce_scatter = reduce_scatter_tensor_coalesced = _refuse
    alltoall = alltoall_base = gather = scatter = reduce = send = recv = recv_anysource = _refuse


def _create_identity(store: Any, rank: int, size: int, timeout: Any) -> _IdentityGroup:
    return _IdentityGroup(rank, size)


def stable_default_group(rank: int, world: int) -> None:
    """Give this process the default group that DeviceMesh/FSDP ask for the rank: a group of a
    registered backend that refuses every collective, on a private HashStore (no peer contact).
    Call it once per process when it first gets its rank (a survivor keeps its rank for life; a
    spare gets the dead rank's). Idempotent for the same (rank, world); another rank or world is
    an error. (Collectives through c10d's dispatcher, e.g. all_gather_into_tensor, fail with
    "No backend type associated with device type cpu" instead of the message above.)"""
    P.check()
    if dist.is_initialized():
        pg = dist.distributed_c10d._get_default_group()
        if not isinstance(pg, _IdentityGroup):
            raise RuntimeError(
                f"the default process group is already a {dist.get_backend()} group. HINT: ckptless_hpc forms its own "
                "groups per generation: do not call init_process_group in a worker"
            )
        if (pg.rank(), pg.size()) != (rank, world):
            raise RuntimeError(
                f"this process already has rank {pg.rank()} of {pg.size()}; asked for rank {rank} of {world}. HINT: a "
                "process keeps its rank for life (a spare gets one once): a different rank means a second worker in this process"
            )
        return
    if IDENTITY_BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(IDENTITY_BACKEND, _create_identity, devices=["cpu", "cuda"])
    dist.init_process_group(IDENTITY_BACKEND, store=dist.HashStore(), rank=rank, world_size=world)


# ------------------------------------------------------------------ groups
def register_group(comm_or_backend: Any, name: Optional[str] = None, global_ranks: Optional[Sequence[int]] = None, store: Any = None) -> dist.ProcessGroup:
    """A generation's backend (or a Communicator: its ``pg``; name ``gen<g>`` and ranks 0..world-1
    by default) as a ``ProcessGroup`` registered in c10d's world, usable by DeviceMesh and FSDP2.
    ``global_ranks[i]`` is the global rank of group rank i. Give it back with :func:`forget_group`
    when the generation is retired (c10d's world would otherwise keep it alive)."""
    P.check()
    backend = getattr(comm_or_backend, "pg", comm_or_backend)
    if name is None:
        gen = getattr(comm_or_backend, "gen", None)
        if gen is None:
            raise ValueError("register_group needs a name for a bare backend. HINT: name=f'gen{g}'")
        name = f"gen{gen}"
    if global_ranks is None:
        global_ranks = list(range(backend.size()))
    if len(global_ranks) != backend.size():
        raise ValueError(f"group {name!r}: {len(global_ranks)} global ranks for a backend of size {backend.size()}")
    if P.registered(name):
        raise ValueError(f"a process group named {name!r} is already registered. HINT: one name per generation (gen<g>, gen<g>/shard<r>)")
    return P.wrap_backend(backend, name, global_ranks, store if store is not None else dist.HashStore())


def forget_group(pg: dist.ProcessGroup) -> None:
    """Unregister a retired generation's group from c10d (its backend is not touched)."""
    P.forget(pg)


def _forget_registered(objs: List[Any]) -> None:
    for o in objs:
        if isinstance(o, dist.ProcessGroup) and P.is_registered_pg(o):
            P.forget(o)


def release_in_background(objs: List[Any]) -> None:
    """Let go of a failed generation's groups at once: unregister each registered group from
    c10d, then drop the last references in a daemon thread (``objs`` is emptied there; the caller
    must hold no other reference: FSDPBinding.unbind() first). A gloo group closes its connections
    only when destroyed (``shutdown()``/``abort()`` leave them open and do not release a blocked
    op), so this is what releases a peer blocked in a collective with this rank on a group that
    did not fail here (HSDP: a rank of another replica waiting in the cross-replica all-reduce):
    "Connection closed by peer" in milliseconds instead of the group's timeout. The destructor
    waits for the group's threads: a group stuck on a hung peer holds only that thread."""
    _forget_registered(objs)  # in a frame of its own: no loop variable here keeps the last one alive
    threading.Thread(target=objs.clear, name="release-generation", daemon=True).start()


@dataclass
class HSDPGroups:
    shard: dist.ProcessGroup  # the ranks of this rank's replica (FSDP2 shards over it)
    replicate: dist.ProcessGroup  # the same shard index in every replica (the all-reduce hook)
    shard_index: int
    replica: int
    comms: List[Any]  # the two Communicators (group ranks), for release() (NCCL: abort)

    def groups(self) -> List[Any]:
        """Everything to hand to :func:`release_in_background` when the generation fails."""
        return [self.shard, self.replicate, *self.comms]


def hsdp_layout(rank: int, world: int, shard_size: int) -> Tuple[List[int], List[int]]:
    """(global ranks of rank's shard group, of its replicate group): replica = rank // shard_size
    (contiguous ranks: put a replica's ranks on one node or one fast domain), shard index =
    rank % shard_size."""
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"parallel.shard_size={shard_size} does not divide the world size {world}. HINT: pick a divisor of {world}")
    r, s = divmod(rank, shard_size)
    return [r * shard_size + i for i in range(shard_size)], list(range(s, world, shard_size))


def form_hsdp_groups(
    store: Any, gen: int, rank: int, world: int, shard_size: int, host: str, timeout_s: float, device: Optional[torch.device] = None, backend: Optional[str] = None
) -> HSDPGroups:
    """Generation ``gen``'s two HSDP sub-groups, each formed by ``Communicator.form`` (gloo, or
    NCCL for a CUDA device) on its own prefix of the job store (``hsdp/shard<r>/gen<g>``,
    ``hsdp/rep<s>/gen<g>``) and registered as ``gen<g>/shard<r>`` and ``gen<g>/rep<s>``."""
    shard_ranks, rep_ranks = hsdp_layout(rank, world, shard_size)
    r, s = divmod(rank, shard_size)
    device = device or torch.device("cpu")
    comms, pgs = [], []
    for kind, ranks in ((f"shard{r}", shard_ranks), (f"rep{s}", rep_ranks)):
        comm = Communicator.form(dist.PrefixStore(f"hsdp/{kind}", store), gen, ranks.index(rank), len(ranks), host, timeout_s, device, backend)
        comms.append(comm)
        pgs.append(register_group(comm, f"gen{gen}/{kind}", ranks))
    return HSDPGroups(pgs[0], pgs[1], s, r, comms)


# ------------------------------------------------------------------ units
def default_units(model: nn.Module) -> List[nn.Module]:
    """Each child holding parameters (a ModuleList/ModuleDict, or a Sequential without parameters
    of its own, is opened one level: each layer is a unit), except children sharing a parameter
    with another unit or with the root (tied weights stay with the root, their common ancestor)."""
    units: List[nn.Module] = []
    for child in model.children():
        container = isinstance(child, (nn.ModuleList, nn.ModuleDict)) or (isinstance(child, nn.Sequential) and not list(child.parameters(recurse=False)))
        units.extend(c for c in (child.children() if container else [child]) if any(True for _ in c.parameters()))
    owners: Dict[int, int] = {}
    for u in units:
        for p in u.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    for p in model.parameters(recurse=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    tied = {pid for pid, n in owners.items() if n > 1}
    return [u for u in units if not any(id(p) in tied for p in u.parameters())]


def units_for(task: Any, model: nn.Module) -> List[nn.Module]:
    """The task's ``shard_units(model)`` if it has one, else :func:`default_units`."""
    fn = getattr(task, "shard_units", None)
    units = list(fn(model)) if callable(fn) else default_units(model)
    names = {id(m) for m in model.modules()}
    bad = [type(u).__name__ for u in units if id(u) not in names or u is model]
    if bad:
        raise ValueError(
            f"{type(task).__name__}.shard_units returned modules that are not strict submodules of the model: {bad}. HINT: return submodules, not the root (it is always a unit)"
        )
    return units


# ------------------------------------------------------------------ the binding
class _ReplicaMean:
    """FSDP's all-reduce hook for HSDP: FSDP has averaged over the shard group; sum over the
    replicate group, then divide by its size: the mean over all ranks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, shard_grad: torch.Tensor) -> None:
        dist.all_reduce(shard_grad, group=self.group)
        shard_grad.div_(self.group.size())


class FSDPBinding:
    """A model sharded with FSDP2 over one generation's (shard) group, re-bindable to the next."""

    def __init__(self, model: nn.Module, mesh: Any, group: dist.ProcessGroup, hook: Optional[_ReplicaMean]) -> None:
        self.model, self.mesh, self.group, self.hook = model, mesh, group, hook

    @classmethod
    def shard(
        cls,
        model: nn.Module,
        group: dist.ProcessGroup,
        hsdp_replicate_group: Optional[dist.ProcessGroup] = None,
        units: Optional[Sequence[nn.Module]] = None,
        rank: Optional[int] = None,
        mesh: Any = None,
        **fully_shard_kwargs: Any,
    ) -> "FSDPBinding":
        """``fully_shard`` each unit (default :func:`default_units`), then the root, over
        ``group`` (FSDP: the generation's group; HSDP: the shard group, with the cross-replica
        mean on ``hsdp_replicate_group``). ``rank``: this process's global rank (default
        ``dist.get_rank()``). ``mesh``: a 1-D mesh over ``group`` to shard on (tp x shard: the
        dp_shard slice of a 2-D mesh; default: one made here). ``fully_shard_kwargs`` go to every
        call (e.g. ``mp_policy``); ``reshard_after_forward`` must stay a bool (an int makes a
        second, post-forward mesh)."""
        from torch.distributed.fsdp import fully_shard

        P.check()
        raf = fully_shard_kwargs.get("reshard_after_forward", True)
        if not isinstance(raf, bool):
            raise ValueError(f"reshard_after_forward={raf!r}: only True/False can be re-bound. HINT: leave the default (True)")
        for key in ("mesh", "shard_placement_fn"):
            if key in fully_shard_kwargs:
                raise ValueError(f"{key} is set by FSDPBinding (one 1-D mesh per generation group)")
        rank = dist.get_rank() if rank is None else rank
        ranks = dist.get_process_group_ranks(group)
        mesh = P.mesh_of(group, ranks, rank, _device_type(model)) if mesh is None else mesh
        for unit in default_units(model) if units is None else units:
            fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
        fully_shard(model, mesh=mesh, **fully_shard_kwargs)
        hook = None
        if hsdp_replicate_group is not None:
            hook = _ReplicaMean(hsdp_replicate_group)
            for m in _fsdp_modules(model):
                m.set_all_reduce_hook(hook)
        return cls(model, mesh, group, hook)

    def rebind(self, new_group: dist.ProcessGroup, new_replicate_group: Optional[dist.ProcessGroup] = None) -> float:
        """Point the same mesh and every FSDP parameter group/parameter at the next generation's
        group(s); the seconds it took. The ranks must be the same (they never change for a
        survivor; a spare takes the dead rank's number)."""
        t0 = time.perf_counter()
        old, new = P.mesh_ranks(self.mesh), list(dist.get_process_group_ranks(new_group))
        if old != new:
            raise ValueError(
                f"rebind: the new group's global ranks {new} differ from the mesh's {old}. HINT: same rank numbers in every generation; a degraded (smaller) world needs a new binding"
            )
        if (self.hook is None) != (new_replicate_group is None):  # noqa: SIM102
            raise ValueError("rebind: an HSDP binding needs new_replicate_group, an FSDP one must not get it")
        P.rebind_mesh(self.mesh, new_group)
        for info in P.mesh_infos(self.model):
            if P.info_mesh(info) is not self.mesh:
                raise RuntimeError("an FSDP unit is on a mesh FSDPBinding did not make (fully_shard applied outside it?)")
            P.set_shard_group(info, new_group)
        if self.hook is not None:
            assert new_replicate_group is not None
            self.hook.group = new_replicate_group
        self.group = new_group
        return time.perf_counter() - t0

    def unbind(self) -> List[dist.ProcessGroup]:
        """Drop every reference the mesh, FSDP and the HSDP hook hold to the current groups, and
        return them (for :func:`release_in_background`). Until :meth:`rebind`, any collective of
        the model fails (no group), which is what a failed generation wants."""
        groups = [self.group] + ([self.hook.group] if self.hook is not None and self.hook.group is not None else [])
        P.unbind_mesh(self.mesh)
        for info in P.mesh_infos(self.model):
            P.set_shard_group(info, None)
        if self.hook is not None:
            self.hook.group = None
        self.group = None
        return groups

    def reset(self) -> None:
        """After a failed forward/backward: FSDP's per-iteration state reset (on the root), and
        every gradient dropped (the step is redone from the committed state). Buffers the failed
        forward changed are the caller's to put back."""
        self.model.reset_iter_state()  # type: ignore[operator]
        P.drop_unsharded_grads(self.model)  # reset_iter_state leaves the no-sync accumulation of the unsharded parameters
        for p in self.model.parameters():
            p.grad = None
        self.set_sync(True)

    def set_sync(self, flag: bool) -> None:
        """False for the micro-batches before the last one of a step (no reduce-scatter, no
        all-reduce: gradients accumulate unsharded), True for the last."""
        self.model.set_requires_gradient_sync(flag)  # type: ignore[operator]

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the (reduced) gradients: local sum of squares over this rank's
        shards (float64), summed over the current generation's shard group. HSDP: the replicas hold
        identical gradients after the hook, so the shard group's sum is the global one."""
        sq = local_squares(self.model, {})[1].clone()
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt()

    def clip(self, max_norm: float, total: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scale the gradients so their global norm is at most ``max_norm`` (torch's formula);
        returns the norm before clipping."""
        total = self.grad_norm() if total is None else total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    g = _local(p.grad)
                    g.mul_(coef.to(g.dtype))
        return total


def _fsdp_modules(model: nn.Module) -> List[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_squares(model: torch.nn.Module, shard_dims: Dict[str, int]) -> torch.Tensor:
    """[TP-sharded, TP-replicated] (no TP, shard_dims={}: all in [1]): this rank's local gradients' squared L2 norms in float64, each
    added in the parameters' order (Python floats are IEEE binary64, as a float64 tensor's adds:
    the same bits as ``sq[i] += vector_norm(g, dtype=float64).pow(2)`` per gradient), with one
    ``_foreach_norm`` and one copy to the host instead of six dispatches and a copy per gradient.
    A DTensor gradient's local part is taken under no_grad: its own tensor, without autograd."""
    with torch.no_grad():
        named = [(n in shard_dims, _local(p.grad)) for n, p in model.named_parameters() if p.grad is not None]
        squares = torch.stack(torch._foreach_pow(torch._foreach_norm([g for _, g in named], 2, dtype=torch.float64), 2)).tolist() if named else []
    sums = [0.0, 0.0]
    for (sharded, _), v in zip(named, squares):
        sums[0 if sharded else 1] += v
    return torch.tensor(sums, dtype=torch.float64)


# ------------------------------------------------------------------ local-shard state
def _fqns(model: nn.Module) -> Dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def own_entries(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Entries:
    """This rank's state as named tensors, views of the live tensors (clone to keep them):
    ``param/<fqn>`` each parameter's local shard, ``buffer/<fqn>`` each buffer (FSDP2 does not
    shard buffers: keep them identical on every rank, or they are per-rank state),
    ``optim/<fqn>/<key>`` each optimizer state tensor's local shard (and scalar tensors such as
    Adam's ``step``). No collective."""
    with torch.no_grad():
        # _local(t).detach(), not _local(t.detach()): a DTensor's detach is a dispatched DTensor op
        # (1.5 ms a step for a 0.74 M TP rank's 117 tensors); the same storage either way
        out: Entries = [(f"param/{n}", _local(p).detach()) for n, p in model.named_parameters()]
        out += [(f"buffer/{n}", b) for n, b in model.named_buffers()]
        if optimizer is not None:
            fqns = _fqns(model)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    for key, v in sorted(optimizer.state.get(p, {}).items()):
                        if v is None:
                            continue
                        if not isinstance(v, torch.Tensor):
                            raise ValueError(
                                f"optimizer state {fqns.get(id(p), '?')}/{key} is a {type(v).__name__}, not a tensor. HINT: "
                                "optimizers keeping Python numbers in their state are not supported by the sharded modes"
                            )
                        out.append((f"optim/{fqns[id(p)]}/{key}", _local(v).detach()))
    return out


def load_own(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], entries: Entries) -> None:
    """Copy ``entries`` (from :func:`own_entries` of the same rank, or of the same shard index of
    another replica) into this rank's existing local tensors, in place. Optimizer state missing
    here (a fresh optimizer) is created first, explicitly: a tensor shaped like the parameter's
    local shard becomes a DTensor like the parameter (``zeros_like``), anything else a plain
    tensor; no optimizer step runs. Every entry must land and every tensor must get one; all is
    checked before anything is written (a refused load changes nothing)."""
    named = dict(entries)
    if len(named) != len(entries):
        raise ValueError("load_own: duplicate entry names")
    params = dict(model.named_parameters())
    targets = dict(own_entries(model, optimizer))
    create, unknown = [], []
    for name, t in named.items():
        if name in targets:
            continue
        fqn, _, key = name[len("optim/") :].rpartition("/")
        if name.startswith("optim/") and optimizer is not None and fqn in params:
            create.append((params[fqn], key, t))
        else:
            unknown.append(name)
    missing = sorted(n for n in targets if n not in named)
    if unknown or missing:
        raise ValueError(
            f"load_own: entries do not match this model/optimizer: missing {missing[:5]}, unknown {sorted(unknown)[:5]}. "
            "HINT: the entries must come from the same model and optimizer, at the same shard index"
        )
    for name, dst in targets.items():
        src = named[name]
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ValueError(
                f"load_own: {name}: the entry is {tuple(src.shape)} {src.dtype}, this rank's tensor {tuple(dst.shape)} {dst.dtype}. "
                "HINT: the entries must come from the same shard index, world/shard size and precision"
            )
    with torch.no_grad():
        for p, key, t in create:
            local = _local(p.detach())
            if t.dim() > 0 and tuple(t.shape) == tuple(local.shape):
                optimizer.state[p][key] = torch.zeros_like(p.detach(), dtype=t.dtype)  # type: ignore[union-attr]
            else:
                optimizer.state[p][key] = torch.zeros_like(t, device=local.device if t.dim() > 0 else t.device)  # type: ignore[union-attr]
        for name, dst in own_entries(model, optimizer):
            dst.copy_(named[name])


# ------------------------------------------------------------------ hot-spare warm-up
def warm_up(
    model_factory: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module], torch.Tensor],
    optimizer_factory: Optional[Callable[[nn.Module], torch.optim.Optimizer]] = None,
    units_fn: Optional[Callable[[nn.Module], Sequence[nn.Module]]] = None,
    host: str = "127.0.0.1",
    **fully_shard_kwargs: Any,
) -> Dict[str, float]:
    """A throwaway ``fully_shard`` + forward/backward/optimizer step on a private 1-rank gloo
    group, before this process has a rank: a hot spare's first real ``fully_shard`` is then
    fast. No default group is needed or made; the private group is unregistered after. Returns
    the seconds of each phase."""
    from torch.distributed.fsdp import fully_shard

    P.check()
    t0 = time.perf_counter()
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    backend = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
    name = f"ckptless_warmup_{id(backend)}"
    pg = P.wrap_backend(backend, name, [0], dist.HashStore())
    try:
        model = model_factory()
        mesh = P.mesh_of(pg, [0], 0, _device_type(model), dim_name="ckptless_warmup")  # never equal to a real mesh
        t1 = time.perf_counter()
        for unit in default_units(model) if units_fn is None else units_fn(model):
            fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
        fully_shard(model, mesh=mesh, **fully_shard_kwargs)
        t2 = time.perf_counter()
        opt = optimizer_factory(model) if optimizer_factory is not None else torch.optim.Adam(model.parameters(), lr=0.0)
        loss_fn(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        own_entries(model, opt)
        t3 = time.perf_counter()
    finally:
        P.forget(pg)
        P.clear_dtensor_caches()  # nothing may stay keyed by the throwaway mesh
    return {"setup_s": t1 - t0, "fully_shard_s": t2 - t1, "step_s": t3 - t2, "total_s": time.perf_counter() - t0}
