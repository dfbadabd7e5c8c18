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
same on every rank) and the task's tensors.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Set, Tuple

import torch


def partition(sizes: List[int], world: int) -> List[int]:
    """Owner rank of each parameter (by index), balancing elements."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ZeroPartition:
    def __init__(self, model: torch.nn.Module, full: torch.optim.Optimizer, world: int, rank: int) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if len(named) < world:
            raise ValueError(
                f"parallel=zero shards whole parameter tensors and the model has {len(named)} for {world} ranks. "
                "HINT: use parallel=fsdp (it splits tensors), parallel=ddp, or fewer ranks"
            )
        self.world, self.rank = world, rank
        owners = partition([p.numel() for _, p in named], world)
        self.owner_of = {id(p): o for (_, p), o in zip(named, owners)}
        mine = {id(p) for (_, p), o in zip(named, owners) if o == rank}
        self.model_keys: Set[str] = {n for (n, _), o in zip(named, owners) if o == rank}
        self.model_keys |= {k for k in model.state_dict() if k not in dict(model.named_parameters())}  # buffers
        groups = []
        for g in full.param_groups:
            sub = {k: v for k, v in g.items() if k != "params"}
            sub["params"] = [p for p in g["params"] if id(p) in mine]
            groups.append(sub)
        accepted = inspect.signature(type(full).__init__).parameters
        self.optimizer = type(full)(groups, **{k: v for k, v in full.defaults.items() if k in accepted})
        # per (owner, dtype): the parameters it sends, in model order
        self._sends: List[Tuple[int, List[torch.Tensor]]] = []
        for o in range(world):
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for (_, p), ow in zip(named, owners):
                if ow == o:
                    by_dtype.setdefault(p.dtype, []).append(p)
            self._sends += [(o, ps) for ps in by_dtype.values()]
        self._flats: List[torch.Tensor] = []
        self.stale = True  # other owners' parameters are not yet this step's

    def launch_sync(self, comm: Any) -> List[Any]:
        """Every owner's parameters to everyone (broadcasts); :meth:`land_sync` after the wait."""
        self._flats = []
        futures = []
        for owner, params in self._sends:
            if owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            self._flats.append(flat)
            futures.append(comm.broadcast(flat, owner))
        return futures

    def land_sync(self) -> None:
        with torch.no_grad():
            for (owner, params), flat in zip(self._sends, self._flats):
                if owner == self.rank:
                    continue
                off = 0
                for p in params:
                    p.copy_(flat[off : off + p.numel()].view_as(p))
                    off += p.numel()
        self._flats = []
        self.stale = False

    def owned_numel(self) -> int:
        return sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])
