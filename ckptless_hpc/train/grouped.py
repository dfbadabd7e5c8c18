"""What the strategies of the modes whose ranks hold a local part of the model share (fsdp, hsdp,
tp, pp): a rank's state is its local tensors; the model is prepared (sharded, parallelized, cut
into a stage) at the first generation, when the rank has its groups, and the optimizer is built
after that, over what the rank holds; a state that arrives before (a promoted spare fetches it
before its generation's groups exist) is applied right after; the groups of a failed generation
are destroyed at once (a gloo group releases a peer blocked in one of its collectives only when
destroyed); a collective that fails inside the step raises ``StepFailed``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..state.snapshot import Entries, plain_meta
from . import fsdp
from .comm import Communicator
from .strategy import OneOptimizer


class StepFailed(RuntimeError):
    """A collective inside a step's forward/backward failed (a peer died or its group was released)."""


def is_comm_error(e: BaseException) -> bool:
    """A failed collective, or an error raised from one (torch's pipeline stage re-raises a
    forward's failure, a TP collective's under pp x tp, as its own ``RuntimeError`` from it)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, getattr(torch.distributed, "DistError", ())):
            return True
        text = str(seen)
        if isinstance(seen, RuntimeError) and any(s in text for s in ("gloo", "Gloo", "Connection closed", "Connection reset", "NCCL", "no group")):
            return True
        seen = seen.__cause__
    return False


@contextmanager
def collectives(what: str) -> Iterator[None]:
    """A failed collective inside the block (a dead peer, a released group) raised as ``StepFailed``."""
    try:
        yield
    except Exception as err:
        if is_comm_error(err):
            raise StepFailed(f"{what}: {err}") from None
        raise


def lay_out_as_params(model: torch.nn.Module) -> bool:
    """Each DTensor gradient laid out as its parameter, before anything reads its local part.
    Sequence parallel (torchtitan's plan) leaves two kinds that are not: a replicated norm
    weight's gradient comes out of backward ``Partial`` (each TP rank's sum over its part of the
    sequence), summed here over the TP group, all of them in one all-reduce; and a row-wise
    embedding's gradient ``Replicate`` where its weight is ``Shard(0)``, sliced (no collective).
    Plain TP leaves none (no collective, nothing changed). Returns whether any was laid out anew:
    the plan decides the layouts, so a model that had none to lay out at one step has none at
    the next (the caller stops asking: 0.5 ms a step for a 0.74 M TP rank's 39 gradients)."""
    from torch.distributed.tensor import DTensor, Replicate

    partial: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
    changed = False
    with torch.no_grad():
        for p in model.parameters():
            g = p.grad
            if not isinstance(g, DTensor) or g.placements == p.placements:
                continue
            changed = True
            if g.device_mesh.ndim == 1 and g.placements[0].is_partial("sum"):
                partial.append((p, g.to_local()))
            else:
                p.grad = g.redistribute(p.device_mesh, p.placements)
        for mesh in {id(p.grad.device_mesh): p.grad.device_mesh for p, _ in partial}.values():
            mine = [(p, t) for p, t in partial if p.grad.device_mesh is mesh]
            flat = torch.cat([t.reshape(-1) for _, t in mine])
            torch.distributed.all_reduce(flat, group=mesh.get_group())
            for (p, t), v in zip(mine, flat.split([t.numel() for _, t in mine])):
                whole = DTensor.from_local(v.view_as(t), mesh, [Replicate()], run_check=False)
                p.grad = whole if tuple(p.placements) == (Replicate(),) else whole.redistribute(mesh, p.placements)
    return changed


@dataclass
class MeshGroups(fsdp.HSDPGroups):
    """pp x tp's groups of a generation: ``shard`` is the pipeline, ``replicate`` the replicate
    group (as pp's), ``tp`` the stage's TP group; tp x shard's: ``shard`` the FSDP shard group (the
    same TP rank of every TP group of the replica); ``extra`` what :meth:`groups` adds for release."""

    tp: Any = None
    pipe: Any = None  # pp x shard x tp: the pipeline (same replica, pipeline and TP rank)
    extra: List[Any] = field(default_factory=list)

    def groups(self) -> List[Any]:
        return [*super().groups(), *self.extra]


def mesh_coordinate(rank: int, pp: int, tp: int) -> Tuple[int, int, int]:
    """(replica, stage, TP rank) of ``rank`` in replicas of ``pp x tp`` ranks: rank = r*pp*tp + s*tp + t
    (a stage's TP group is consecutive ranks: one node, or one fast domain). tp x shard: ``pp`` is
    the FSDP shard count and ``s`` the shard index."""
    r, c = divmod(rank, pp * tp)
    s, t = divmod(c, tp)
    return r, s, t


def form_mesh_groups(store: Any, comm: Any, pp: int, tp: int, host: str, timeout_s: float, device: torch.device, outer: str = "pp") -> MeshGroups:
    """Generation ``comm.gen``'s pp x tp groups, each formed by ``Communicator.form`` on its own
    prefix of the job store and registered as ``gen<g>/<kind>``: the pipeline (same replica and
    TP rank), the stage's TP group (same replica and stage), the replicate group (same
    coordinate in every replica). tp x shard: ``outer="sh"``, the FSDP shard group in the
    pipeline's place (``pp`` shards)."""
    size = pp * tp
    r, s, t = mesh_coordinate(comm.rank, pp, tp)
    kinds = [
        (f"{outer}{r}_{t}", [r * size + i * tp + t for i in range(pp)]),
        (f"rep{s}_{t}", list(range(s * tp + t, comm.world, size))),
        (f"tp{r}_{s}", [r * size + s * tp + i for i in range(tp)]),
    ]
    comms, pgs = _form_kinds(store, comm, kinds, host, timeout_s, device)
    return MeshGroups(pgs[0], pgs[1], s * tp + t, r, comms[:2], tp=pgs[2], extra=[pgs[2], comms[2]])


def form_pp_shard_tp_groups(store: Any, comm: Any, pp: int, shards: int, tp: int, host: str, timeout_s: float, device: torch.device) -> MeshGroups:
    """Generation ``comm.gen``'s pp x shard x tp groups (all four dims: rank ``r*S*P*T + d*P*T +
    s*T + t`` is TP rank ``t`` of stage ``s`` of pipeline ``d`` of replica ``r``), formed as
    :func:`form_mesh_groups`' are: the stage's FSDP shard group (same replica, stage and TP rank:
    ``shard``), the replicate group, the stage's TP group (consecutive: ``tp``) and the pipeline
    (same replica, pipeline and TP rank: ``pipe``)."""
    size, inner = shards * pp * tp, pp * tp
    r, c = divmod(comm.rank, size)
    d, st = divmod(c, inner)
    s, t = divmod(st, tp)
    base = r * size
    kinds = [
        (f"sh{r}_{s}_{t}", [base + i * inner + s * tp + t for i in range(shards)]),
        (f"rep{c}", list(range(c, comm.world, size))),
        (f"tp{r}_{d}_{s}", [base + d * inner + s * tp + i for i in range(tp)]),
        (f"pp{r}_{d}_{t}", [base + d * inner + i * tp + t for i in range(pp)]),
    ]
    comms, pgs = _form_kinds(store, comm, kinds, host, timeout_s, device)
    return MeshGroups(pgs[0], pgs[1], c, r, comms[:2], tp=pgs[2], pipe=pgs[3], extra=[pgs[2], pgs[3], comms[2], comms[3]])


def _form_kinds(store: Any, comm: Any, kinds: List[Tuple[str, List[int]]], host: str, timeout_s: float, device: torch.device) -> Tuple[List[Any], List[Any]]:
    """Each ``(kind, global ranks)`` group this rank is in, formed by ``Communicator.form`` on its
    own prefix of the job store and registered as ``gen<g>/<kind>``: (communicators, groups)."""
    comms, pgs = [], []
    for kind, ranks in kinds:
        c = Communicator.form(dist.PrefixStore(f"mesh/{kind}", store), comm.gen, ranks.index(comm.rank), len(ranks), host, timeout_s, device, comm.backend)
        comms.append(c)
        pgs.append(fsdp.register_group(c, f"gen{comm.gen}/{kind}", ranks))
    return comms, pgs


def gradient_buckets(grads: List[torch.Tensor], limit_bytes: int) -> List[List[torch.Tensor]]:
    """``grads`` in order, cut into runs of one dtype and device of at most ``limit_bytes`` each
    (a gradient larger than that is a run of its own)."""
    buckets: List[List[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = buckets[-1] if buckets else None
        if last is None or (g.dtype, g.device) != (last[0].dtype, last[0].device) or size + nbytes > limit_bytes:
            buckets.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return buckets


class LocalState(OneOptimizer):
    """The shared members of :class:`.fsdp_strategy.FSDPStrategy`, :class:`.tp.TPStrategy` and
    :class:`.pp.PPStrategy`; a subclass says when it is ``ready`` (prepared) and what its state's
    metadata adds (:meth:`meta_extra`)."""

    sharded = True
    e: Any
    replica_size = 1  # tp, pp: ranks per replica (replica 0 alone adds the norm's squares)
    reduced_by_fsdp = False  # pp x shard: FSDP2 reduces the gradients inside the stage's backward

    def __init__(self, engine: Any) -> None:
        self.e = engine
        self._pending: Optional[Tuple[Entries, Dict[str, Any]]] = None
        self._norm: Optional[torch.Tensor] = None
        self._relayout = True  # whether the gradients may come out laid out unlike their parameters (lay_out_as_params)

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    def meta_extra(self) -> Dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ generations
    def warm_up(self) -> Optional[Dict[str, float]]:
        return None

    def layout(self) -> Dict[str, int]:
        return {"buckets": 0}  # no buckets: the mode reduces its own gradients

    def build_optimizer(self) -> None:
        """Once prepared: the optimizer and the scheduler over what this rank holds, then the
        state that arrived before (with its metadata)."""
        e = self.e
        e.optimizer = e.task.build_optimizer(e.model, e.cfg.optim)
        e.scheduler = e.build_scheduler()
        if self._pending is not None:
            entries, meta = self._pending
            self._pending = None
            self.apply(entries, meta)
            e.apply_meta(meta)

    def release_groups(self, comm: Any, objs: List[Any]) -> bool:
        """After a failed step: the generation's communicator and groups (and ``objs``, what the
        mode held of them) destroyed at once, in a thread. ``objs`` is extended in place and
        emptied in that thread: the caller's list holds the last references (a pipeline's
        schedule) only until the thread drops them, never after it."""
        self.e.comm = None
        objs.append(comm)
        hs = getattr(comm, "hsdp", None)
        if hs is not None:
            objs += hs.groups()
            comm.hsdp = None
        del hs
        # the communicators' backends too: the callers' frames still hold the communicators
        # (a destroyed group waits for its op in flight, up to cluster.collective_timeout_s)
        for c in [o for o in objs if isinstance(o, Communicator) and o.pg is not None]:
            objs.append(c.pg)
            c.pg = None
        fsdp.release_in_background(objs)
        return True

    # ------------------------------------------------------------------ one step
    def begin(self, comm: Any, wait: Callable[[List[Any]], None]) -> None:
        self._norm = None

    def grad_norm(self) -> torch.Tensor:
        assert self._norm is not None, "the norm is computed inside the step (forward_backward): a collective"
        return self._norm

    def divide(self, n: int) -> None:
        pass  # the mean over the global batch is made inside the step, before the norm

    def stepped(self) -> None:
        pass

    def mean_over_replicas(self, group: Any, n: int) -> None:
        """Each local gradient summed over the replicate ``group``, in place, and divided by ``n``
        (the micro-batches of every replica): the mean over the global batch, before the norm.
        The gradients go in buckets of ``train.bucket_mb`` (one all-reduce each, as DDP's; a
        gradient larger than that alone, in place): a gloo all-reduce per tensor cost 7 ms of CPU
        a step against 2 ms for one bucket (the 19 gradients of a 0.37 M stage, 2 ranks; the
        elementwise sums are the same). A DTensor gradient's local part is taken under no_grad: its
        own tensor, without autograd's ``to_local`` (0.5 ms a step for 39 gradients)."""
        if self._relayout:
            self._relayout = lay_out_as_params(self.e.model)
        with torch.no_grad():
            grads = [fsdp._local(p.grad) for p in self.e.model.parameters() if p.grad is not None]
        limit = int(float(self.e.cfg.train.bucket_mb) * (1 << 20))
        for bucket in gradient_buckets(grads, limit):
            flat = bucket[0] if len(bucket) == 1 and bucket[0].is_contiguous() else torch.cat([g.reshape(-1) for g in bucket])
            torch.distributed.all_reduce(flat, group=group)
            flat.div_(n)
            if flat is not bucket[0]:
                for g, v in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(v.view_as(g))

    def reduce_and_norm(self, comm: Any, wait: Callable[[List[Any]], None], buffer_comm: Any) -> torch.Tensor:
        """After the last backward (tp, pp): the gradients made the global mean over the replicas
        (``self.rep_group``), then one all-reduce over the generation's group carries the step's
        loss (and the task's metrics), whether any rank wrote a buffer in this step
        (:meth:`.replicated.BufferSync.changed`) and the squares of the global norm
        (:meth:`_norm_squares`); rank 0's buffers are broadcast over ``buffer_comm`` only when some
        rank wrote one (a RoPE table or a causal mask never is: no broadcast). One collective a
        step where the loss, the buffers and the norm took three (``python -m bench --only parallel``)."""
        e = self.e
        if not self.reduced_by_fsdp:  # pp x shard: FSDP2 made them the mean in the stage's backward
            self.mean_over_replicas(self.rep_group, (e.world // self.same_batch) * e.micro_batches)  # type: ignore[attr-defined]
        head = e.reduction()
        written = 1.0 if e.buffers and e.buffers.changed() else 0.0
        total = torch.cat([head, torch.tensor([written, self._norm_squares(comm.rank)], dtype=head.dtype, device=head.device)])
        wait([comm.allreduce(total)])
        e.reduced(total[: head.numel()])
        if float(total[-2]) > 0:
            wait(e.buffers.launch(buffer_comm))
        self._norm = total[-1].sqrt()
        return self._norm

    def _norm_squares(self, rank: int) -> float:
        """This rank's part of the squared global norm, summed by the step's one all-reduce: its
        TP-sharded gradients' local squares, and the replicated ones' on TP rank 0 only (every
        rank of a TP group holds them whole); nothing outside replica 0, since every replica holds
        the same reduced gradients (a sum of zeros and one replica's squares: no rounding from
        counting it several times)."""
        if rank // self.replica_size:
            return 0.0
        sq = fsdp.local_squares(self.e.model, self.shard_dims)  # type: ignore[attr-defined]
        return float(sq[0]) + (float(sq[1]) if rank % self.tp == 0 else 0.0)  # type: ignore[attr-defined]

    def clip(self, max_norm: float, norm: torch.Tensor) -> None:
        """Every local gradient scaled so that the global norm is at most ``max_norm`` (torch's formula)."""
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for p in self.e.model.parameters():
                if p.grad is not None:
                    g = fsdp._local(p.grad)
                    g.mul_(coef.to(g.dtype))

    def discard(self) -> None:
        for p in self.e.model.parameters():
            p.grad = None

    def evaluate(self, batch: Any) -> Any:
        """The task's evaluate on a model whose forward runs collectives: a failed one raises as
        in a step (``StepFailed``)."""
        with collectives("evaluation"):
            return self.e.task.evaluate(self.e.run_model, batch)

    # ------------------------------------------------------------------ state
    def collect(self, step: int, extra: Dict[str, Any], shard: Optional[int] = None) -> Tuple[Entries, Dict[str, Any]]:
        """This rank's local tensors (:func:`.fsdp.own_entries`), the task's tensors, and in the
        metadata the optimizer's hyper-parameters, its parameters by name (state/dcp.py) and the
        task's scalars."""
        e = self.e
        entries = fsdp.own_entries(e.model, e.optimizer if self.ready else None)
        task_scalars: Dict[str, Any] = {}
        for k, v in sorted((e.task.state_dict() or {}).items()):
            if torch.is_tensor(v):
                entries.append((f"task/{k}", v))
            else:
                task_scalars[k] = v
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in e.optimizer.param_groups]
        name_of = {id(p): n for n, p in e.model.named_parameters()}
        groups = [[name_of[id(p)] for p in g["params"]] for g in e.optimizer.param_groups]
        meta = {"step": step, "hyper": hyper, "groups": groups, "task_scalars": task_scalars, **self.meta_extra(), **extra}
        return entries, plain_meta(meta)

    def apply(self, entries: Entries, meta: Dict[str, Any], copy: bool = False, shard: Optional[int] = None) -> bool:
        """Copied in place into this rank's tensors, task and optimizer hyper-parameters (checked
        before anything is written: :func:`.fsdp.load_own`); False while not prepared (applied,
        with its metadata, by :meth:`build_optimizer`)."""
        e = self.e
        if not self.ready:
            self._pending = (entries, meta)
            return False
        fsdp.load_own(e.model, e.optimizer, [(n, t) for n, t in entries if not n.startswith("task/")])
        task_sd: Dict[str, Any] = dict(meta.get("task_scalars", {}))
        task_sd.update({n[len("task/") :]: t for n, t in entries if n.startswith("task/")})
        if task_sd:
            e.task.load_state_dict(task_sd)
        for g, h in zip(e.optimizer.param_groups, meta.get("hyper", [])):
            for k, v in h.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
        return True
