"""``parallel=pp``: pipeline parallel inside each replica, data parallel across replicas.

The ranks form pipelines of ``parallel.pp`` consecutive ranks (one replica of the model, best
on one node): rank ``r*P + s`` is stage ``s`` of replica ``r``; the ranks of the same stage in
every replica form the replicate group. Both are formed per generation as hsdp's are
(:func:`.fsdp.form_hsdp_groups`: ``comm.hsdp.shard`` is the pipeline, ``comm.hsdp.replicate``
the replicate group).

The stages come from the task, as torchtitan makes them: every rank builds the whole model
(seeded, the same everywhere: the state's names are the whole model's), then
``Task.pp_stage(model, stage, n_stages)`` returns this rank's stage, the model with the other
stages' modules removed (torchtitan's ``pipeline_llama_manual_split`` deletes the layers a
stage does not own and sets the embedding, norm and head to None; the model's forward skips
what is None), its parameters the model's own under the model's names. The batch reaches the
stages through ``Task.pp_split(batch) -> (inputs, target)`` (the first stage's input, the last
stage's loss target) and the loss through ``Task.pp_loss(output, target)``, the task's loss on
the last stage's output (``loss(model, batch) == pp_loss(model(inputs), target)``).

Interleaved (``parallel.pp_schedule=interleaved_1f1b``, ``parallel.pp_virtual=V`` >= 2): a
pipeline of ``P`` ranks runs ``P x V`` stages, rank ``s`` of it the stages ``s, s+P, ...``
(torch's looped placement), each cut by ``Task.pp_stage(model, stage, P*V)`` from its own copy
of the whole model (:func:`cut_stages`); the engine's model is then :class:`Stages`, their
union under the model's names, so a rank's state is all its stages' entries (disjoint names).

pp x tp (``parallel.tp=T`` > 1): a replica is ``P x T`` ranks, rank ``r*P*T + s*T + t`` TP rank
``t`` of stage ``s`` (:func:`.grouped.mesh_coordinate`); the generation's groups are the pipeline
(same replica and TP rank), the stage's TP group and the replicate group (same ``(s, t)`` in
every replica: :func:`.grouped.form_mesh_groups`). Each stage module is parallelized with the
task's plan (``Task.tp_plan(stage)``) on a 1-D mesh over the TP group (tp.py's, re-pointed at
every later generation's group); the state is then its local shards and, in the metadata, the
dimension each is split along.

pp x shard (``parallel.shard_size=S`` > 1): a replica is ``S`` pipelines of ``P`` consecutive ranks,
rank ``r*P*S + d*P + s`` stage ``s`` of pipeline ``d``, each pipeline a data rank of its own
(``rank // P``); each stage is FSDP2-sharded (:class:`.fsdp.FSDPBinding`: the task's units in it,
then the stage) over the ``S`` ranks holding it, with HSDP's cross-replica mean where there are
replicas; the groups are :func:`.grouped.form_mesh_groups`' with the pipeline in the TP group's
place. torch's stage runs FSDP2's reduce-scatter once, after the last micro-batch's backward, and
the schedule divides the gradients by the micro-batches: no replicate-group sum follows.

All four dims (``shard_size=S`` and ``tp=T``): rank ``r*S*P*T + d*P*T + s*T + t``; the stage is made
tensor parallel on the ``tp`` dim of a 2-D ``(dp_shard, tp)`` mesh over its ranks in the replica, then
FSDP2-sharded on its ``dp_shard`` dim (as tp.py's ``TPShardStrategy`` does the whole model); the
groups are :func:`.grouped.form_pp_shard_tp_groups`'.

A step: a ``torch.distributed.pipelining`` schedule (``parallel.pp_schedule``: ``gpipe``,
``1f1b`` or ``interleaved_1f1b``) over a ``PipelineStage`` of each of this rank's modules on the
pipeline group, with the step's ``train.grad_accum`` micro-batches as its micro-batches: the
rank of the first stage feeds them, that of the last computes their losses. The stages and
their schedule are built at every generation's bind around the same modules (torch's stage
keeps its group, its peers' ranks and the shapes it inferred; a new one infers them again on
the new group in its first step: a few small messages). Then
each parameter's gradient (the sum over this replica's micro-batches) is summed over the
replicate group (in buckets of ``train.bucket_mb``) and divided into the mean over the global batch; then one
all-reduce over the generation's group carries the loss, whether a buffer was written and the
norm's squares (replica 0's stages' own: grouped.py ``reduce_and_norm``). The loss the engine reports is the mean over the world's
ranks and micro-batches: the last stage adds each micro-batch's loss ``P`` times (the other
stages add nothing), as the ranks of a TP group each add the same loss.

Each micro-batch's forward is seeded for its data rank (``rank // P``), stage and index: the first
stage as the engine seeds a rank's forward (the one-process reference's dropout for it), a
later stage with a seed of its own (a pipeline cannot continue the first stage's random stream;
with dropout after the first stage the masks differ from the reference's, not their law).

Evaluation (``train.eval_every``): the validation batch goes through the pipeline forward only
(a second stage and schedule around the same modules, one micro-batch; several stages per rank
through torch's ``ScheduleLoopedBFS``: the whole batch, as the
task's ``evaluate`` sees it; rebuilt at each generation and when the batch's shape changes, which
every rank of the pipeline sees, since they all draw the same batch), and the last stage computes
the task's metrics on its output with ``Task.pp_evaluate(output, target)``
(``evaluate(model, batch) == pp_evaluate(model(inputs), target)``), broadcast to the pipeline's
other ranks: every rank returns the same values, as the ranks of a TP group do, and the engine's
all-reduce makes them the mean over the batches (:meth:`..engine.Engine.evaluate`).

The task's own metrics of a step: ``pp_loss`` may return ``(loss, {"name": ...})`` as ``loss``
does; the last stage adds each micro-batch's metrics ``P`` times, as its loss, and the other
stages add zeros under the same names, learnt from the last stage at each generation's first
step (a spare has never seen them).

State: this rank's stage, whole (:func:`.fsdp.own_entries` of the stage's module: its
parameters, buffers and optimizer state, under the whole model's names); the stages' names are
disjoint, so the export's union of the shards (:func:`ckptless_hpc.state.export.job_view`) is
the whole model. A lost rank's state is its stage's, held by the same stage of every other
replica: no copy is ever sent (as hsdp and tp).
"""

from __future__ import annotations

import copy

from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import same_batch
from . import fsdp
from ..tasks.base import mix_seed, seed_global
from .data import forward_seed
from .evaluation import split_loss
from . import torch_private as P
from .grouped import LocalState, collectives, form_mesh_groups, form_pp_shard_tp_groups
from .replicated import BufferSync
from .tp import parallelize, tp_mesh

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}  # parallel.pp_schedule: torch's class


def schedule_class(name: str) -> Any:
    """torch.distributed.pipelining's schedule class of ``parallel.pp_schedule`` ``name``."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[name])


def stage_of(task: Any, model: torch.nn.Module, stage: int, n_stages: int) -> torch.nn.Module:
    """The task's stage ``stage`` of ``n_stages`` of ``model`` (``Task.pp_stage``), checked: its
    parameters are the model's own under the model's names (the state's names), and a parameter
    tied to another (one tensor under several names) is tied only inside the stage."""
    for name in ("pp_stage", "pp_split", "pp_loss"):
        if not callable(getattr(task, name, None)):
            raise ValueError(
                f"parallel=pp needs {type(task).__name__}.{name}: pp_stage(model, stage, n_stages) -> the stage's module (the model with the "
                "other stages' modules removed, as torchtitan splits its models), pp_split(batch) -> (inputs, target), pp_loss(output, target) -> "
                "the loss. HINT: add them to the task (tests/models/llama.py's LlamaPPTask is an example), or use parallel=ddp|fsdp|tp"
            )
    every = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        every.setdefault(id(p), []).append(n)
    module = task.pp_stage(model, stage, n_stages)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"{type(task).__name__}.pp_stage returned a {type(module).__name__}, not a torch.nn.Module. HINT: return the stage's module")
    mine: Dict[int, List[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        mine.setdefault(id(p), []).append(n)
    for pid, names in mine.items():
        if pid not in every or not set(names) <= set(every[pid]):
            raise ValueError(
                f"{type(task).__name__}.pp_stage({stage}): the stage's parameter {names[0]} is not the model's parameter of that name "
                f"(the model names it {every.get(pid, ['nothing'])[0]}). HINT: remove the other stages' modules from the model itself "
                "(del model.layers[i]; model.output = None), so that the stage keeps the model's names"
            )
        if set(names) != set(every[pid]):
            raise ValueError(
                f"{type(task).__name__}.pp_stage({stage}): the parameter {every[pid][0]} is tied to {sorted(set(every[pid]) - set(names))}, "
                "which another stage holds: each stage would train its own copy. HINT: untie it, or keep the tied modules in one stage"
            )
    if not mine:
        raise ValueError(
            f"{type(task).__name__}.pp_stage({stage}, {n_stages}) has no parameters. HINT: give every stage a part of the model (fewer stages: parallel.pp, parallel.pp_virtual)"
        )
    return module


def cut_stages(task: Any, model: torch.nn.Module, stages: List[int], n_stages: int) -> List[torch.nn.Module]:
    """This rank's stages ``stages`` of ``n_stages`` (:func:`stage_of`), each cut from its own
    copy of ``model`` (the first from ``model`` itself), the copies taken before any cut. A
    buffer that several of them hold under one name (the rotary table of the model's root) is
    made one tensor, as in the model: the stages' state has each name once."""
    copies = [model] + [copy.deepcopy(model) for _ in stages[1:]]
    modules = [stage_of(task, m, s, n_stages) for m, s in zip(copies, stages)]
    first: Dict[str, torch.Tensor] = {}
    for m in modules:
        for prefix, sub in m.named_modules():
            for leaf, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[leaf] = first.setdefault(f"{prefix}.{leaf}" if prefix else leaf, b)
    return modules


class Stages(torch.nn.Module):
    """A rank's stages (``parallel.pp_virtual`` > 1) as the engine's one model: ``train()``,
    ``eval()`` and ``to()`` reach them all (its children), and its parameters and buffers are
    theirs under the whole model's names (the stages' parameters are disjoint; a buffer they
    share by name is one tensor: :func:`cut_stages`), not under this container's prefixes. The
    stages run through the pipeline's schedule, never through this module's forward."""

    def __init__(self, stages: List[torch.nn.Module]) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)

    def _union(self, kind: str, *args: Any) -> Iterator[Tuple[str, torch.Tensor]]:
        seen = set()
        for st in self.stages:
            for n, t in getattr(st, kind)(*args):
                if n not in seen:
                    seen.add(n)
                    yield n, t

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.nn.Parameter]]:  # type: ignore[override]
        return self._union("named_parameters", prefix, recurse, remove_duplicate)  # type: ignore[return-value]

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:  # type: ignore[override]
        return self._union("named_buffers", prefix, recurse, remove_duplicate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a rank's pipeline stages run through the pipeline's schedule (parallel=pp), not as one module")


def _seeded_stage(base: Any) -> Any:
    """A ``PipelineStage`` class that seeds each micro-batch's forward (``seed(index)``) right
    before it runs: torch's schedules call ``forward_one_chunk`` once per micro-batch, in any
    order the schedule likes, while its shape inference calls the module outside of it. That
    inference (a new stage's first step: every generation's) runs the module once on stand-in
    inputs; what it writes into the stage's buffers (BatchNorm's running statistics, counters) is
    put back, or each generation would count one forward more than the fault-free run and the
    plain reference do."""

    class SeededStage(base):  # type: ignore[misc, valid-type]
        seed: Callable[[int], None] = staticmethod(lambda i: None)

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.seed(fwd_chunk_id)
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:  # torch_private: tests/unit/test_torch_private.py
            kept = [(b, b._version, b.detach().clone()) for b in self.submod.buffers()]
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for b, version, value in kept:
                        if b._version != version:
                            b.copy_(value)

    return SeededStage


class PPStrategy(LocalState):
    """``parallel=pp`` (train/strategy.py; what it shares with fsdp and tp: train/grouped.py)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        p = engine.cfg.parallel
        self.pp = int(p.pp)
        self.schedule_name = str(p.get("pp_schedule", "gpipe"))
        self.virtual = int(p.get("pp_virtual", 1) or 1)  # stages per rank (interleaved_1f1b)
        self.tp = int(p.get("tp") or 1)  # pp x tp: each stage tensor-parallel over tp ranks
        self.shards = int(p.get("shard_size") or 1)  # pp x shard: pipelines per replica, FSDP2 over each stage's ranks
        self.same_batch = same_batch(p)  # the ranks of a replica (pp x tp: its pipelines of TP groups; pp x shard: a pipeline) compute the same batch
        self.replica_size = self.pp * self.tp * self.shards
        self.reduced_by_fsdp = self.shards > 1  # FSDP2 reduces the gradients in the stage's backward (and the schedule divides them)
        self.binding: Optional[fsdp.FSDPBinding] = None  # pp x shard: FSDP2 over the stage, re-bound at each generation
        self.mesh: Any = None  # pp x tp: the 1-D mesh over the stage's TP group, re-pointed at each generation's (x shard: the 2-D (dp_shard, tp) mesh)
        self.tp_mesh: Any = None  # pp x shard x tp: the 2-D mesh's tp slice (the plan's)
        self.tp_group: Any = None
        self.shard_dims: Dict[str, int] = {}  # pp x tp: the dimension each sharded parameter of this rank's stages is split along
        self.stage_index = -1
        self.module: Optional[torch.nn.Module] = None  # this rank's stage (its stages: a Stages), built at the first bind
        self.stage_modules: List[torch.nn.Module] = []  # this rank's stages' modules, in stage order
        self.pp_group: Any = None
        self.rep_group: Any = None
        self.rep_comm: Any = None
        self.schedule: Any = None
        self._step = 0
        self._micro_metrics: List[Optional[Mapping[str, Any]]] = []  # the last stage's: each micro-batch's metrics (pp_loss)
        self._names_shared = False  # the task's metric names sent down the pipeline in this generation
        self.eval_schedule: Any = None  # forward only, built at the generation's first evaluation
        self._eval_key: Any = None  # the shape and dtype of the batch it was built for
        if int(engine.cfg.train.get("eval_every", 0) or 0) > 0 and not callable(getattr(engine.task, "pp_evaluate", None)):
            raise ValueError(
                f"train.eval_every is set with parallel=pp, but {type(engine.task).__name__} has no pp_evaluate(output, target): the pipeline's "
                'last stage computes the task\'s metrics on its output. HINT: add pp_evaluate(output, target) -> {"name": scalar} '
                "(evaluate(model, batch) == pp_evaluate(model(inputs), target) with (inputs, target) = pp_split(batch); examples/llama.py's "
                "LlamaPPTask has one), or set train.eval_every=0"
            )

    @property
    def ready(self) -> bool:
        return self.module is not None

    # ------------------------------------------------------------------ generations (cut to its stage, and given its optimizer, at the first bind)
    def meta_extra(self) -> Dict[str, Any]:
        """What the export joins the TP shards along (pp x tp), and the FSDP2 shards of each TP rank's part (x shard)."""
        if self.tp == 1:
            return {}
        return {"shard_dims": dict(self.shard_dims), **({"fsdp_shards": self.shards} if self.shards > 1 else {})}

    def meshes(self) -> List[Any]:
        """Every mesh the stage's DTensors and hooks hold: pp x tp's 1-D TP mesh; pp x shard x tp's
        2-D mesh, its tp slice and FSDP2's (pp x shard alone: the binding re-points its own)."""
        if self.mesh is None:
            return []
        return [self.mesh, self.tp_mesh, *P.fsdp_param_meshes(self.module)] if self.binding is not None else [self.mesh]

    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None:
        """The generation's pipeline and replicate groups (train/fsdp.py's hsdp groups; pp x tp:
        and the stage's TP group, train/grouped.py), as ``comm.hsdp``."""
        e = self.e
        if self.shards > 1 and self.tp > 1:
            comm.hsdp = form_pp_shard_tp_groups(store, comm, self.pp, self.shards, self.tp, host, timeout_s, e.device)
        elif self.shards > 1:  # the TP groups' place is the pipeline's (consecutive ranks), the pipeline's the FSDP shard group's
            comm.hsdp = form_mesh_groups(store, comm, self.shards, self.pp, host, timeout_s, e.device, outer="sh")
        elif self.tp > 1:
            comm.hsdp = form_mesh_groups(store, comm, self.pp, self.tp, host, timeout_s, e.device)
        else:
            comm.hsdp = fsdp.form_hsdp_groups(store, comm.gen, comm.rank, comm.world, self.pp, host, timeout_s, e.device, comm.backend)

    def let_go(self, comm: Any) -> bool:
        """The generation's groups are destroyed at once, in a thread (a peer blocked in one that
        did not fail here is released only then), with the stages and schedules that hold them:
        their last references go in that thread too (dropped here, the main thread hung in a
        destructor waiting on the failed step's ops, and never answered the abort: pp x tp, a
        rank that did not hold within cluster.recovery_timeout_s); first in the list, so the
        groups go first."""
        held = [self.schedule, self.eval_schedule]
        self.schedule = self.eval_schedule = None
        self.pp_group = self.rep_group = self.rep_comm = self.tp_group = None
        for m in self.meshes():
            P.unbind_mesh(m)
        if self.binding is not None:
            held += self.binding.unbind()
        return self.release_groups(comm, held)

    def bind(self, comm: Any) -> None:
        """The first generation: the model cut to this rank's stages, then the optimizer and
        scheduler built over their parameters; every generation: new stages and a new schedule on
        its pipeline group, around the same modules."""
        e = self.e
        hs = comm.hsdp
        rep = hs.replicate if e.world > self.replica_size else None  # pp x shard with one replica: no cross-replica mean
        if self.shards > 1:  # pp x shard: the pipeline is form_mesh_groups' "tp" (x tp: "pipe"), the stage's FSDP shard group its "sh"
            self.pp_group, self.rep_group, self.rep_comm = hs.pipe if self.tp > 1 else hs.tp, hs.replicate, hs.comms[1]
            self.tp_group = hs.tp if self.tp > 1 else None
            if self.binding is not None:
                for m in self.meshes():
                    P.point_mesh(m, {"dp_shard": hs.shard, "tp": hs.tp})
                self.binding.rebind(hs.shard, rep)
        else:
            self.pp_group, self.rep_group, self.rep_comm, self.tp_group = hs.shard, hs.replicate, hs.comms[1], getattr(hs, "tp", None)
            if self.mesh is not None:
                P.rebind_mesh(self.mesh, self.tp_group)
        if self.module is None:
            fsdp.stable_default_group(comm.rank, comm.world)
            self.stage_index = comm.rank % (self.pp * self.tp) // self.tp  # rank r*S*P*T + d*P*T + s*T + t (S, T: 1 when unset)
            self.stage_modules = cut_stages(e.task, e.model, self.stage_ids(), self.pp * self.virtual)
            if self.shards > 1:  # FSDP2 over the same stage of the replica's pipelines: the task's units in it, then the stage
                (stage,) = self.stage_modules
                mesh = None
                if self.tp > 1:  # x tp: the task's plan on the tp dim of a 2-D (dp_shard, tp) mesh over the stage's ranks, FSDP2 on its dp_shard dim
                    base, inner = comm.rank - comm.rank % self.replica_size, self.pp * self.tp
                    rows = [[base + d * inner + self.stage_index * self.tp + t for t in range(self.tp)] for d in range(self.shards)]
                    self.mesh = P.mesh_2d(rows, ("dp_shard", "tp"), comm.rank, e.device.type, {"dp_shard": hs.shard, "tp": hs.tp})
                    self.tp_mesh = self.mesh["tp"]
                    self.shard_dims.update(parallelize(e.task, stage, self.tp_mesh))
                    mesh = self.mesh["dp_shard"]
                self.binding = fsdp.FSDPBinding.shard(stage, hs.shard, rep, units=fsdp.units_for(e.task, stage), rank=comm.rank, mesh=mesh)
            elif self.tp > 1:  # each stage parallelized with the task's plan on one mesh over the stage's TP group
                self.mesh = tp_mesh(self.tp_group, comm.rank, e.device)
                for m in self.stage_modules:
                    self.shard_dims.update(parallelize(e.task, m, self.mesh))
            self.module = self.stage_modules[0] if self.virtual == 1 else Stages(self.stage_modules)
            e.model = e.run_model = self.module
            e.buffers = BufferSync(self.module)  # this rank's stages' buffers, from replica 0's same stages
            self.build_optimizer()
        from torch.distributed.pipelining import PipelineStage

        data_rank = comm.rank // self.same_batch
        stages = self._stages(_seeded_stage(PipelineStage))
        for st in stages:
            st.seed = lambda micro, v=st.stage_index: self._seed(data_rank, v, micro)
        kind = schedule_class(self.schedule_name)
        # scale_grads=False: the gradients stay sums over the micro-batches, made the global mean below; pp x shard:
        # FSDP2 reduces them once, after the last micro-batch (torch's stage), as the mean over its shards and the
        # replicas (the all-reduce hook), and the schedule divides them by the micro-batches (as torchtitan's)
        self.schedule = kind(stages if self.virtual > 1 else stages[0], n_microbatches=e.micro_batches, loss_fn=self._loss, scale_grads=self.reduced_by_fsdp)
        self.eval_schedule = self._eval_key = None
        self._names_shared = False

    def stage_ids(self) -> List[int]:
        """This rank's stages, of ``pp x pp_virtual``: ``s, s + pp, s + 2 pp, ...`` (torch's
        looped placement, which its interleaved schedules expect)."""
        return [self.stage_index + k * self.pp for k in range(self.virtual)]

    def _stages(self, cls: Any) -> List[Any]:
        """A ``cls`` (a ``PipelineStage``) around each of this rank's stage modules, on the generation's pipeline group."""
        n = self.pp * self.virtual
        return [cls(m, i, n, self.e.device, group=self.pp_group) for m, i in zip(self.stage_modules, self.stage_ids())]

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """The schedule's loss of one micro-batch (the last stage): the task's ``pp_loss``, its
        metrics, if it returns ``(loss, {...})``, kept for the step's sums."""
        task = self.e.task
        loss, metrics = split_loss(task.pp_loss(output, target), task)
        if not torch.is_tensor(loss):
            raise ValueError(f'{type(task).__name__}.pp_loss returned a {type(loss).__name__} as its loss, not a tensor. HINT: return the loss tensor, or (loss, {{"name": ...}})')
        self._micro_metrics.append(metrics)
        return loss

    def _seed(self, data_rank: int, stage: int, micro: int) -> None:
        seed = int(self.e.cfg.train.seed)
        if stage == 0:
            forward_seed(seed, self._step, data_rank, micro)
        else:
            seed_global(mix_seed(seed, self._step, data_rank, micro, 5, stage))

    # ------------------------------------------------------------------ one step
    def _inputs(self, step: int) -> Tuple[Any, Any]:
        """The step's micro-batches, split by the task into the first stage's inputs and the last
        stage's targets, each joined along dim 0 (the schedule splits them back, in order)."""
        e = self.e
        ins, targets = [], []
        for micro in range(e.micro_batches):
            x, y = e.task.pp_split(e.feed.get(step, micro))
            ins.append(x.to(e.device))
            targets.append(y.to(e.device))
        sizes = {int(t.shape[0]) for t in ins + targets}
        if len(sizes) != 1:
            raise ValueError(f"{type(e.task).__name__}.pp_split gave micro-batches of sizes {sorted(sizes)} (dim 0). HINT: parallel=pp needs micro-batches of one size")
        return torch.cat(ins), torch.cat(targets)

    def forward_backward(self, step: int, comm: Any, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> Optional[torch.Tensor]:
        """The pipeline's forwards and backwards, then the gradients made the global mean over the
        replicas and the step's one all-reduce (the loss, the buffers' flag, the norm: grouped.py),
        replica 0's buffers broadcast over the replicate group where written."""
        e = self.e
        e.optimizer.zero_grad(set_to_none=True)
        self._step = step
        first, last = self.stage_index == 0, self.stage_index == self.pp - 1
        self._micro_metrics = []
        with collectives(f"step {step}"):
            x, y = self._inputs(step)
            losses: List[torch.Tensor] = []
            args = (x,) if first else ()
            with e.autocast():
                if last:
                    self.schedule.step(*args, target=y, losses=losses, return_outputs=False)
                else:
                    self.schedule.step(*args, return_outputs=False)
            for loss in losses:  # counted once per rank of the pipeline: the engine divides by world x micro-batches
                e.add_loss(loss.detach().to(torch.float64) * self.pp)
            self._add_metrics(last)
            on_backward()
            return self.reduce_and_norm(comm, wait, self.rep_comm)

    def _add_metrics(self, last: bool) -> None:
        """The task's metrics of the step into the engine's sums: the last stage's, each counted
        once per rank of the pipeline (as its loss); zeros under the same names on the other
        stages, which learn the names from the last stage at the generation's first step."""
        e = self.e
        if last:  # the micro-batches' (torch's shape inference, at a generation's first step, calls the loss once before them)
            for metrics in self._micro_metrics[-e.micro_batches :]:
                if metrics is not None or e.metrics.names is not None:
                    e.metrics.add(metrics or {}, e.device, weight=float(self.pp))
        if not self._names_shared:
            names = [e.metrics.names if last else None]
            dist.broadcast_object_list(names, group=self.pp_group, group_src=self.pp - 1, device=e.device)
            self._names_shared = True
            if not last and names[0] and e.metrics.names is None:
                e.metrics.add({n: 0.0 for n in names[0]}, e.device, weight=0.0)  # the sums stay zeros: the names and the vector's length

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, batch: Any) -> Dict[str, Any]:
        """The task's metrics of one validation batch: the batch forward only through the
        pipeline, ``Task.pp_evaluate`` on the last stage's output, broadcast to the pipeline (every
        rank returns the same values). A failed collective raises as in a step (``StepFailed``)."""
        e = self.e
        x, y = e.task.pp_split(batch)
        first, last = self.stage_index == 0, self.stage_index == self.pp - 1
        with collectives("evaluation"):
            schedule = self._eval_schedule(x)
            out = schedule.step(x.to(e.device)) if first else schedule.step()  # pp x shard: the stages end resharded (a final state right after is their shards)
            values = [_eval_metrics(e.task, out, y.to(e.device)) if last else None]
            dist.broadcast_object_list(values, group=self.pp_group, group_src=self.pp - 1, device=e.device)
        return values[0]

    def _eval_schedule(self, x: torch.Tensor) -> Any:
        """The generation's forward-only schedule over one micro-batch, for batches shaped as ``x``
        (every rank of the pipeline draws the same batch: they rebuild it together); several
        stages per rank go through torch's looped schedule (ScheduleLoopedBFS: each stage's
        forward in turn)."""
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS

        key = (tuple(x.shape), x.dtype)
        if self.eval_schedule is None or key != self._eval_key:
            stages = self._stages(PipelineStage)
            schedule = ScheduleLoopedBFS(stages, n_microbatches=1) if self.virtual > 1 else ScheduleGPipe(stages[0], n_microbatches=1)
            self.eval_schedule, self._eval_key = schedule, key  # no loss_fn: forward only
        return self.eval_schedule

    def discard(self) -> None:
        """After a failed step: pp x shard resets FSDP2's per-iteration state too (fsdp_strategy.py's)."""
        if self.binding is not None:
            self.binding.reset()
        super().discard()


def _eval_metrics(task: Any, output: Any, target: Any) -> Dict[str, Any]:
    """The task's ``pp_evaluate`` on the last stage's output, as plain CPU values to broadcast."""
    metrics = task.pp_evaluate(output, target)
    if not isinstance(metrics, Mapping):
        raise ValueError(f'{type(task).__name__}.pp_evaluate returned a {type(metrics).__name__}, not a dict. HINT: return {{"name": scalar tensor or float, ...}}')
    return {str(k): v.detach().cpu() if torch.is_tensor(v) else v for k, v in metrics.items()}
