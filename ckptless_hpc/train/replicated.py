"""The replicated (data-parallel) strategy, :class:`Replicated` (``parallel=ddp``): gradients
reduced in fixed buckets (or the fixed tree, train/fixed.py), buffers broadcast from rank 0, as
torch DDP does by default.

Gradients are views of flat buffers, one per parameter dtype, laid out in reverse parameter
order (the order backward produces them) and cut into buckets of ``train.bucket_mb``. On the
last micro-batch of a step a bucket's allreduce starts as soon as its last gradient is
accumulated, overlapping the rest of the backward pass; earlier micro-batches only accumulate.
Fixed boundaries and a fixed order keep the result bitwise reproducible.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..config import reduction
from ..state.snapshot import Entries, apply_state, collect_state
from .fixed import FixedReduce
from .strategy import OneOptimizer


class BucketedGrads:
    def __init__(self, params: List[torch.Tensor], bucket_bytes: int, device: torch.device) -> None:
        self.params = params
        self._groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in reversed(params):
            self._groups.setdefault(p.dtype, []).append(p)
        self._bucket_bytes, self._device = bucket_bytes, device
        self._layout()
        self._comm: Any = None
        self._left: List[int] = []
        self.futures: List[Optional[Any]] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _layout(self) -> None:
        self.flats: List[torch.Tensor] = []
        self.buckets: List[torch.Tensor] = []  # slices of the flats, in launch-order index
        self._sizes: List[int] = []  # parameters per bucket
        self._bucket_of: Dict[int, int] = {}
        for dtype, group in self._groups.items():
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=self._device)
            self.flats.append(flat)
            limit = max(1, self._bucket_bytes // flat.element_size())
            off = start = 0
            count = 0
            for p in group:
                p.grad = flat[off : off + p.numel()].view_as(p)
                self._bucket_of[id(p)] = len(self.buckets)
                off += p.numel()
                count += 1
                if off - start >= limit or off == flat.numel():
                    self.buckets.append(flat[start:off])
                    self._sizes.append(count)
                    start, count = off, 0

    def renew(self) -> None:
        """Fresh gradient memory after a step that did not finish: an abandoned generation's
        allreduce may still be running in its group's thread (stuck on a peer that is frozen,
        or fed late by one that forwarded part of a ring), and would write into the buffers the
        redone step uses. The old ones stay with those operations until their group is released."""
        self._comm = None
        self._layout()

    def zero(self) -> None:
        for f in self.flats:
            f.zero_()

    def arm(self, comm: Any, launch: Optional[Callable[[torch.Tensor], Any]] = None) -> None:
        """The next backward is the step's last: launch each bucket's allreduce (or ``launch``:
        the fixed-order reduction's all-to-all, train/fixed.py) as it fills."""
        self._comm = comm
        self._start = launch or comm.allreduce
        self._left = list(self._sizes)
        self.futures = [None] * len(self.buckets)

    def disarm(self) -> None:
        self._comm = None

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self._comm is None:  # an earlier micro-batch, or a backward outside a step
            return
        b = self._bucket_of[id(p)]
        self._left[b] -= 1
        if self._left[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        self.futures[b] = self._start(self.buckets[b])

    def launch_rest(self) -> List[Any]:
        """Launch the buckets no hook started (parameters unused this step); all futures."""
        for b, fut in enumerate(self.futures):
            if fut is None:
                self._launch(b)
        return list(self.futures)

    def divide(self, divisor: int) -> None:
        for f in self.flats:
            f.div_(divisor)

    def total_norm(self) -> torch.Tensor:
        """Global L2 norm of the (already reduced) gradients, identical on every rank."""
        return torch.nn.utils.get_total_norm(self.flats, norm_type=2.0)

    def clip(self, max_norm: float, total: torch.Tensor) -> None:
        """Scale the gradients so their global norm is at most ``max_norm`` (torch's formula)."""
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for f in self.flats:
            f.mul_(coef.to(f.dtype))


class BufferSync:
    """Every registered buffer (BatchNorm running statistics, counters, ...) takes rank 0's value
    at each step, as torch DDP's ``broadcast_buffers=True`` does, so that every replica holds the
    same committed state. The broadcast is launched after the step's last forward and lands
    before the step commits; a step that does not commit puts the buffers back as they were."""

    def __init__(self, model: torch.nn.Module) -> None:
        groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        for b in model.buffers():
            groups.setdefault(b.dtype, []).append(b)
        self.groups: List[Tuple[torch.dtype, List[torch.Tensor]]] = list(groups.items())
        self._saved: List[torch.Tensor] = []
        self._packed: List[torch.Tensor] = []
        self._versions: Optional[List[int]] = None  # the buffers' version counters when they last landed

    def changed(self) -> bool:
        """Whether a buffer was written in place since the buffers last landed (its version
        counter moved, as autograd's in-place checks see it), or they never landed here."""
        bufs = [b for _, group in self.groups for b in group]
        return self._versions is None or any(b._version != v for b, v in zip(bufs, self._versions))

    def __bool__(self) -> bool:
        return bool(self.groups)

    def snapshot(self) -> List[torch.Tensor]:
        return [b.detach().clone() for _, bufs in self.groups for b in bufs]

    def save(self) -> None:
        """Keep the step's starting values (:meth:`restore` puts them back)."""
        self._saved = self.snapshot()

    def restore(self, values: Optional[List[torch.Tensor]] = None) -> None:
        """Put back the saved values, or ``values`` (a :meth:`snapshot`)."""
        values = self._saved if values is None else values
        if not values:
            return
        with torch.no_grad():
            for b, s in zip((b for _, bufs in self.groups for b in bufs), values):
                b.copy_(s)

    def launch(self, comm: Any, root: int = 0) -> List[Any]:
        """Broadcast ``root``'s buffers (the process holding virtual rank 0, train/fixed.py), each
        dtype's as its raw bytes: any dtype a model holds (a complex RoPE cache, a bool mask) goes
        as the backend's plainest type."""
        self._packed = [torch.cat([b.detach().contiguous().reshape(-1).view(torch.uint8) for b in bufs]) for _, bufs in self.groups]
        return [comm.broadcast(t, root) for t in self._packed]

    def land(self) -> None:
        with torch.no_grad():
            for (dtype, bufs), packed in zip(self.groups, self._packed):
                values = packed.view(dtype)  # one dtype per group: every buffer starts at a whole element
                off = 0
                for b in bufs:
                    b.copy_(values[off : off + b.numel()].view_as(b))
                    off += b.numel()
        self._packed = []
        self._versions = [b._version for _, group in self.groups for b in group]


class Replicated(OneOptimizer):
    """``parallel=ddp``: every rank holds the whole state (train/strategy.py). Gradients land in
    :class:`BucketedGrads`; they are summed by the buckets' all-reduce, overlapped with the last
    backward, or (``train.reduction=fixed``) in the fixed tree over the ranks (train/fixed.py),
    the same bits whatever the number of processes, which a job that shrinks needs."""

    sharded = False

    def __init__(self, engine: Any) -> None:
        e = self.e = engine
        t = e.cfg.train
        params = [p for p in e.model.parameters() if p.requires_grad]
        self.grads = BucketedGrads(params, int(float(t.bucket_mb) * (1 << 20)), e.device)
        self.fixed = reduction(e.cfg) == "fixed"
        self._plan: Optional[FixedReduce] = None

    # ------------------------------------------------------------------ generations
    def bind(self, comm: Any) -> None:
        if self.fixed:
            self._plan = FixedReduce(self.e.world, comm.holders or [[r] for r in range(self.e.world)], comm.rank)
        elif comm.holders is not None:
            raise ValueError(f"generation {comm.gen}: ranks {comm.vranks} on one process need train.reduction=fixed")

    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None:
        pass

    def let_go(self, comm: Any) -> bool:
        return False  # the caller keeps the generation referenced and retires it once idle

    def warm_up(self) -> Optional[Dict[str, float]]:
        return None

    def layout(self) -> Dict[str, int]:
        return {"buckets": len(self.grads.buckets)}

    # ------------------------------------------------------------------ one step
    def begin(self, comm: Any, wait: Callable[[List[Any]], None]) -> None:
        self.grads.zero()

    def forward_backward(self, step: int, comm: Any, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> Optional[torch.Tensor]:
        e = self.e
        if self._plan is not None and comm.holders is None:  # a rank per process: the all-to-alls start as backward fills the buckets
            futures = self._fixed_overlapped(step, comm, self._plan, on_backward, wait)
        elif self._plan is not None:
            futures = self._fixed_step(step, comm, self._plan, on_backward, wait)
        else:
            futures = self._forward_backward(step, comm)
            on_backward()
            futures = self.grads.launch_rest() + [comm.allreduce(e.reduction())] + futures
            self.grads.disarm()
        wait(futures)
        return None

    def _forward_backward(self, step: int, comm: Any, launch: Optional[Callable[[torch.Tensor], Any]] = None) -> List[Any]:
        e = self.e
        broadcasts: List[Any] = []
        for micro in range(e.micro_batches):
            batch = e.feed.get(step, micro)
            e.seed(step, comm.rank, micro)
            last = micro == e.micro_batches - 1
            if last:
                self.grads.arm(comm, launch)
            with e.autocast():
                loss = e.task_loss(batch)
            if last and e.buffers:  # the forward has updated them: rank 0's go to everyone
                broadcasts = e.buffers.launch(comm)
            e.add_loss(loss)
            e.backward(loss)
        return broadcasts

    def _fixed_overlapped(self, step: int, comm: Any, plan: FixedReduce, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> List[Any]:
        """train.reduction=fixed with a rank per process (a job that has not shrunk): each
        bucket's all-to-all starts as backward fills it, as the all-reduce does; then each
        process combines its chunks and the all-gathers bring them back (the same bits as
        :meth:`_fixed_step`: the sum is elementwise). Returns the buffers' broadcasts."""
        broadcasts = self._forward_backward(step, comm, launch=lambda bucket: plan.start(comm, [bucket]))
        on_backward()
        exchanges = self.grads.launch_rest() + [plan.start(comm, [self.e.reduction()])]
        self.grads.disarm()
        wait([x.future for x in exchanges])
        wait([plan.gather(comm, x) for x in exchanges])
        for bucket, x in zip(self.grads.buckets, exchanges):
            bucket.copy_(x.out)
        self.e.reduced(exchanges[-1].out)
        return broadcasts

    def _fixed_step(self, step: int, comm: Any, plan: FixedReduce, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> List[Any]:
        """train.reduction=fixed: each rank this process trains (its own; in a shrunk job the lost
        ones' too) runs its micro-batches from the step's buffers, its gradient (the micro-batches
        summed as autograd accumulates them), loss and metrics kept apart; the sums over all
        ranks come from the fixed tree, and the buffers from the process that trains rank 0, as
        rank 0's forwards left them. Returns the buffers' broadcasts to wait on."""
        e = self.e
        leaves: Dict[int, List[torch.Tensor]] = {}
        rank0: Optional[List[torch.Tensor]] = None
        vranks = comm.vranks
        for i, v in enumerate(vranks):
            last = i == len(vranks) - 1
            if i > 0:  # the next rank starts from the step's state, as on a process of its own
                self.grads.zero()
                e.restart_sums()
                e.buffers.restore()
            for micro in range(e.micro_batches):
                batch = e.feed.get_for(step, micro, v)
                e.seed(step, v, micro)
                with e.autocast():
                    loss = e.task_loss(batch)
                e.add_loss(loss)
                e.backward(loss)
            leaves[v] = [f if last else f.clone() for f in self.grads.flats] + [e.reduction().clone()]
            if v == 0 and not last and e.buffers:
                rank0 = e.buffers.snapshot()
        if rank0 is not None:
            e.buffers.restore(rank0)
        on_backward()
        broadcasts = e.buffers.launch(comm, plan.root) if e.buffers else []
        *grads, total = plan.reduce(comm, plan.partials(leaves), wait)
        e.reduced(total)
        for flat, g in zip(self.grads.flats, grads):
            flat.copy_(g)
        return broadcasts

    def discard(self) -> None:
        self.grads.disarm()
        self.grads.renew()  # the failed generation's operations may still write into the old memory

    def divide(self, n: int) -> None:
        self.grads.divide(n)

    def grad_norm(self) -> torch.Tensor:
        return self.grads.total_norm()

    def clip(self, max_norm: float, norm: torch.Tensor) -> None:
        self.grads.clip(max_norm, norm)

    def stepped(self) -> None:
        pass

    def evaluate(self, batch: Any) -> Any:
        return self.e.task.evaluate(self.e.run_model, batch)

    # ------------------------------------------------------------------ state
    def collect(self, step: int, extra: Dict[str, Any], shard: Optional[int]) -> Tuple[Entries, Dict[str, Any]]:
        e = self.e
        return collect_state(e.model, e.optimizer, e.task, step, extra)

    def apply(self, entries: Entries, meta: Dict[str, Any], copy: bool, shard: Optional[int]) -> bool:
        e = self.e
        if copy:
            entries = [(n, t.clone()) for n, t in entries]
        apply_state(e.model, e.optimizer, e.task, entries, meta)
        return True
