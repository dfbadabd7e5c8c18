"""The replicated (data-parallel) strategy: gradients reduced in fixed buckets, buffers
broadcast from rank 0, as torch DDP does by default.

Gradients are views of flat buffers, one per parameter dtype, laid out in reverse parameter
order (the order backward produces them) and cut into buckets of ``train.bucket_mb``. On the
last micro-batch of a step a bucket's allreduce starts as soon as its last gradient is
accumulated, overlapping the rest of the backward pass; earlier micro-batches only accumulate.
Fixed boundaries and a fixed order keep the result bitwise reproducible.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


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
