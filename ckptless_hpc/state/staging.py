"""The state's bytes as host memory slices, in canonical order, for the wire.

CPU tensors are read in place. Device tensors are staged through a small ring of pinned host
buffers in large chunks: the copy of chunk k+1 runs on a side stream (DMA) while chunk k is
hashed and sent, instead of one synchronous ``.cpu()`` per tensor. A slot is reused only once
its chunk has been sent and hashed (the hasher finishes a slice before it takes the next one),
which the ring's depth guarantees: at most ``depth - 2`` copies run ahead of the slice handed out.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Iterator, Sequence, Tuple

import torch

from .snapshot import byte_view

Slice = Tuple[int, int, memoryview]  # (entry index, byte offset in that entry, bytes)


class CudaCopies:
    """Device-to-host copies on a side stream, each chunk into a pinned slot, with an event."""

    def __init__(self, chunk: int, depth: int) -> None:
        self.slots = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self.stream = torch.cuda.Stream()

    def start(self, slot: int, src: torch.Tensor) -> Any:
        dst = self.slots[slot][: src.numel()]
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def finish(self, slot: int, n: int, token: Any) -> memoryview:
        token.synchronize()
        return memoryview(self.slots[slot][:n].numpy()).cast("B")


def _device_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def host_slices(
    tensors: Sequence[torch.Tensor], chunk: int, depth: int = 4, copies: Any = None, staged: Callable[[torch.Tensor], bool] = lambda t: t.device.type != "cpu"
) -> Iterator[Slice]:
    """Every tensor's bytes in order, as (entry index, offset, host memoryview) of at most
    ``chunk`` bytes. ``copies`` stages the tensors ``staged`` names (built on first need:
    CudaCopies)."""
    if depth < 3:
        raise ValueError(f"depth={depth}: the ring needs at least 3 slots (one sent, one hashed, one copying)")
    pending: Deque[Tuple[int, int, int, int, Any]] = deque()  # (entry, offset, slot, n, token)
    next_slot = 0
    for i, t in enumerate(tensors):
        if not staged(t):
            while pending:  # keep the order: device chunks before this tensor go out first
                yield _finish(copies, pending.popleft())
            mv = byte_view(t)
            for off in range(0, len(mv), chunk):
                yield i, off, mv[off : off + chunk]
            continue
        if copies is None:
            copies = CudaCopies(chunk, depth)
        src = _device_bytes(t)
        for off in range(0, src.numel(), chunk):
            if len(pending) >= depth - 2:
                yield _finish(copies, pending.popleft())
            part = src[off : off + chunk]
            pending.append((i, off, next_slot, part.numel(), copies.start(next_slot, part)))
            next_slot = (next_slot + 1) % depth
    while pending:
        yield _finish(copies, pending.popleft())


def _finish(copies: Any, item: Tuple[int, int, int, int, Any]) -> Slice:
    i, off, slot, n, token = item
    return i, off, copies.finish(slot, n, token)
