"""train/replicated.py BufferSync.changed: whether a rank wrote a buffer since the buffers last
landed, which the tp and pp step carries in its one all-reduce (train/grouped.py
``reduce_and_norm``): rank 0's buffers are broadcast only when some rank wrote one."""

from __future__ import annotations

import pytest
import torch

from ckptless_hpc.train.replicated import BufferSync

pytestmark = pytest.mark.timeout(30)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)), persistent=False)  # a RoPE table: never written
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.bn = torch.nn.BatchNorm1d(2)


def _landed(sync: BufferSync) -> None:
    sync.launch(_NoComm())
    sync.land()


class _NoComm:
    def broadcast(self, t: torch.Tensor, root: int) -> None:  # one rank: its own bytes land
        return None


def test_a_buffer_is_changed_until_it_lands_and_after_any_in_place_write():
    m = _Model()
    sync = BufferSync(m)
    assert sync.changed()  # never landed here: the first step broadcasts
    _landed(sync)
    assert not sync.changed()
    m.lin(torch.ones(3, 2))  # a forward that writes no buffer
    assert not sync.changed()
    m.count += 1  # a counter
    assert sync.changed()
    _landed(sync)
    assert not sync.changed()
    m.bn.train()
    m.bn(torch.randn(4, 2))  # BatchNorm's running statistics
    assert sync.changed()
    _landed(sync)
    sync.save()  # the step's starting values: a copy, not a write
    assert not sync.changed()
    sync.restore()  # a step that did not commit put them back: written
    assert sync.changed()
