"""ZeRO-1 (``parallel=zero``): optimizer state sharded over the data-parallel ranks.

Gradients are reduced as in the replicated strategy (every rank holds the mean gradient, so
clipping and the non-finite checks see the same global values everywhere). Each rank steps only
the parameters it owns, with an optimizer of the task's class and hyper-parameters built over
them; the updated parameters go from their owner to everyone at the start of the next step
(one broadcast per owner and dtype). Doing that at the start, not after the optimizer step,
keeps the optimizer step the last thing a step does: a rank's shard (its parameters and their
optimizer state) is either at the old step or at the new one, never torn, whatever fails.

Ownership is by whole parameter tensor, greedy by size (largest first, to the least loaded
rank; ties by rank), a pure function of the model and the world size, so a replacement computes
the same partition. A rank's shard: its parameters, their optimizer state, every buffer (the
same on every rank) and the task's tensors, the model's part by the tensors themselves
(state/views.py: a tie is one parameter, owned once; no ``state_dict`` hook is involved).

In a job that shrank (``cluster.min_nodes``), a survivor also steps the parts of the lost ranks it
trains, each with the optimizer its rank had (:meth:`ZeroPartition.hold`): the partition stays
one of the job's ranks, whatever number of processes holds them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..state.snapshot import apply_state, collect_state
from ..state.views import model_tensors
from .replicated import Replicated


def partition(sizes: List[int], world: int) -> List[int]:
    """Owner rank of each parameter (by index), balancing elements."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


@dataclass
class Part:
    """One rank's part of the optimizer: the parameters it owns, their optimizer (of the task's
    class and hyper-parameters) and that optimizer's scheduler, and the model keys of its shard."""

    optimizer: torch.optim.Optimizer
    model_keys: Set[str]
    scheduler: Any = None


class ZeroPartition:
    """The parts this process steps: its own rank's (``own``), and in a job that shrank those of
    the lost ranks it trains (``adopted``, :meth:`hold`). Each part keeps the optimizer its rank
    would have on a process of its own, so its state (and its fingerprint) is that rank's."""

    def __init__(self, model: torch.nn.Module, full: torch.optim.Optimizer, world: int, rank: int) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if len(named) < world:
            raise ValueError(
                f"parallel=zero shards whole parameter tensors and the model has {len(named)} for {world} ranks. "
                "HINT: use parallel=fsdp (it splits tensors), parallel=ddp, or fewer ranks"
            )
        self.world, self.rank, self._full = world, rank, full
        owners = partition([p.numel() for _, p in named], world)
        self._owned: Dict[int, List[Tuple[str, torch.Tensor]]] = {o: [] for o in range(world)}
        for (n, p), o in zip(named, owners):
            self._owned[o].append((n, p))
        # every shard holds the tensors nobody steps: buffers and frozen parameters (by name, the
        # job's view: state/views.py; a tied parameter is one tensor, owned once)
        stepped = {n for n, _ in named}
        self._buffers = {n for n, _ in model_tensors(model) if n not in stepped}
        self.own = self._part(rank)
        self.adopted: Dict[int, Part] = {}
        # per (owner, dtype): the parameters it sends, in model order
        self._sends: List[Tuple[int, List[torch.Tensor]]] = []
        for o in range(world):
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for _, p in self._owned[o]:
                by_dtype.setdefault(p.dtype, []).append(p)
            self._sends += [(o, ps) for ps in by_dtype.values()]
        self._flats: List[torch.Tensor] = []
        self.stale = True  # other owners' parameters are not yet this step's

    def _part(self, rank: int) -> Part:
        mine = {id(p) for _, p in self._owned[rank]}
        groups = []
        for g in self._full.param_groups:
            sub = {k: v for k, v in g.items() if k != "params"}
            sub["params"] = [p for p in g["params"] if id(p) in mine]
            groups.append(sub)
        full = self._full
        accepted = inspect.signature(type(full).__init__).parameters
        optimizer = type(full)(groups, **{k: v for k, v in full.defaults.items() if k in accepted})
        return Part(optimizer, {n for n, _ in self._owned[rank]} | self._buffers)

    def hold(self, ranks: Sequence[int], scheduler: Callable[[torch.optim.Optimizer], Any]) -> None:
        """Step the parts of ``ranks`` (the own rank's always): a lost rank's part is built fresh
        (its state is loaded next), a rank handed back (a job that grew back) is let go."""
        for r in [r for r in self.adopted if r not in ranks]:
            del self.adopted[r]
        for r in ranks:
            if r != self.rank and r not in self.adopted:
                part = self._part(r)
                part.scheduler = scheduler(part.optimizer)
                self.adopted[r] = part

    def part(self, rank: Optional[int]) -> Part:
        """The part of ``rank`` this process steps (None: its own)."""
        if rank is None or rank == self.rank:
            return self.own
        if rank not in self.adopted:
            raise KeyError(f"rank {self.rank} does not step rank {rank}'s part of the optimizer (it steps {sorted([self.rank, *self.adopted])})")
        return self.adopted[rank]

    def parts(self) -> List[Part]:
        return [self.own, *(self.adopted[r] for r in sorted(self.adopted))]

    def launch_sync(self, comm: Any) -> List[Any]:
        """Every owner's parameters to everyone (broadcasts from the process that steps the
        owner's part); :meth:`land_sync` after the wait."""
        self._flats = []
        futures = []
        for owner, params in self._sends:
            if owner == self.rank or owner in self.adopted:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            self._flats.append(flat)
            futures.append(comm.broadcast(flat, comm.process_of(owner)))
        return futures

    def land_sync(self) -> None:
        with torch.no_grad():
            for (owner, params), flat in zip(self._sends, self._flats):
                if owner == self.rank or owner in self.adopted:
                    continue
                off = 0
                for p in params:
                    p.copy_(flat[off : off + p.numel()].view_as(p))
                    off += p.numel()
        self._flats = []
        self.stale = False


class Zero(Replicated):
    """``parallel=zero`` (train/strategy.py): the replicated strategy's gradients, the optimizer
    partitioned (:class:`ZeroPartition`, built when the process gets its rank); before a step or an
    evaluation the owners' parameters of the last step go to everyone."""

    sharded = True

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.partition: Optional[ZeroPartition] = None

    def take_rank(self, rank: int) -> None:
        e = self.e
        if self.partition is None:
            self.partition = ZeroPartition(e.model, e.optimizer, e.world, rank)
            e.optimizer = self.partition.own.optimizer
            e.scheduler = self.partition.own.scheduler = e.build_scheduler()

    def hold(self, ranks: Sequence[int]) -> None:
        """Step the parts of ``ranks`` (train/zero.py): a part adopted now is built fresh and its
        state loaded next (:meth:`apply` with its ``shard``); a part handed back goes."""
        assert self.partition is not None
        self.partition.hold(ranks, self.e.build_scheduler)

    def shards(self) -> List[int]:
        z = self.partition
        return [] if z is None else [z.rank, *sorted(z.adopted)]

    def parts(self) -> List[Tuple[torch.optim.Optimizer, Any]]:
        assert self.partition is not None
        return [(p.optimizer, p.scheduler) for p in self.partition.parts()]

    def scheduler_of(self, shard: Optional[int]) -> Any:
        return self.partition.part(shard).scheduler if self.partition is not None else self.e.scheduler

    def bind(self, comm: Any) -> None:
        super().bind(comm)
        self.stepped()  # the other owners' parameters come at the next step's start

    def begin(self, comm: Any, wait: Callable[[List[Any]], None]) -> None:
        super().begin(comm, wait)
        z = self.partition
        if z is not None and z.stale:  # the owners' parameters of the last step
            wait(z.launch_sync(comm))
            z.land_sync()

    def stepped(self) -> None:
        if self.partition is not None:
            self.partition.stale = True

    def collect(self, step: int, extra: Dict[str, Any], shard: Optional[int]) -> Tuple[Any, Dict[str, Any]]:
        e = self.e
        if self.partition is None:
            return super().collect(step, extra, shard)
        part = self.partition.part(shard)
        return collect_state(e.model, part.optimizer, e.task, step, extra, model_keys=part.model_keys)

    def apply(self, entries: Any, meta: Dict[str, Any], copy: bool, shard: Optional[int]) -> bool:
        e = self.e
        if self.partition is None:
            return super().apply(entries, meta, copy, shard)
        if copy:
            entries = [(n, t.clone()) for n, t in entries]
        part = self.partition.part(shard)
        apply_state(e.model, part.optimizer, e.task, entries, meta, model_keys=part.model_keys)
        self.stepped()
        if part is self.partition.own:
            return True
        if part.scheduler is not None and meta.get("scheduler") is not None:  # a lost rank's part: its own scheduler; the rest is this rank's
            part.scheduler.load_state_dict(meta["scheduler"])
        return False
