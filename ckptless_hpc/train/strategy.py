"""The seam between the engine and a parallel mode: one ``Strategy`` per mode, one module each.

The engine (train/engine.py) owns what every mode shares: the model and the task, the data feed
and the seeds, the loss and the task's metrics, the buffers' broadcast, the non-finite policy,
the grad scaler, the LR and the hook, and the metadata of a state. A strategy owns what differs:
how a rank holds the state (all of it, a partition of the optimizer, FSDP2's shards), how the
gradients are reduced (bucketed all-reduce, the fixed tree, FSDP2's own reduce-scatter), the
groups a generation needs, and how its state is collected and applied.

- :class:`.replicated.Replicated` (``parallel=ddp``), with the fixed-order reduction
  (:mod:`.fixed`, ``train.reduction=fixed``) as its gradient path where a job may shrink;
- :class:`.zero.Zero` (``parallel=zero``): replicated gradients, the optimizer partitioned;
- :class:`.fsdp_strategy.FSDPStrategy` (``parallel=fsdp`` and ``hsdp``, its shard and replicate
  groups formed per generation);
- :class:`.tp.TPStrategy` (``parallel=tp``): tensor parallel in groups of ``parallel.tp`` ranks
  (the task's plan), data parallel across them; :class:`.tp.TPShardStrategy` with
  ``parallel.shard_size`` > 1: FSDP2 over that many TP groups inside each replica (2-D);
- :class:`.pp.PPStrategy` (``parallel=pp``): pipelines of ``parallel.pp`` stages (the task's
  split), data parallel across them.

A new mode is one more class with these members, and a line in :func:`make`. A strategy whose
ranks compute the same batch in groups (tensor and pipeline parallel) says so with ``same_batch`` (default 1).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

Entries = List[Tuple[str, torch.Tensor]]
Wait = Callable[[List[Any]], None]


class Strategy(Protocol):
    sharded: bool  # a rank holds a part of the state, not all of it (copies go to holders on other nodes)

    # ------------------------------------------------------------------ generations
    def take_rank(self, rank: int) -> None:
        """This process is ``rank`` for life: build what the rank's part needs before a state is loaded."""

    def hold(self, ranks: Sequence[int]) -> None:
        """The ranks this process trains (a job that shrank: lost ones too)."""

    def shards(self) -> List[int]:
        """The shards whose state this process holds live (none in a replicated mode)."""

    def parts(self) -> List[Tuple[torch.optim.Optimizer, Any]]:
        """Each optimizer this process steps, with its scheduler."""

    def scheduler_of(self, shard: Optional[int]) -> Any:
        """The scheduler whose state goes with ``shard``'s (None: this rank's)."""

    def bind(self, comm: Any) -> None:
        """Train with this generation's communicator from now on."""

    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None:
        """The groups of ``comm``'s generation this mode needs besides it."""

    def let_go(self, comm: Any) -> bool:
        """After a failed step: True when this mode released the generation's groups itself."""

    def warm_up(self) -> Optional[Dict[str, float]]:
        """A hot spare's preparation while it waits (timings), or None."""

    def layout(self) -> Dict[str, int]:
        """For the ``built`` message: the gradient buckets."""

    # ------------------------------------------------------------------ one step
    def begin(self, comm: Any, wait: Wait) -> None:
        """Before a step's (or an evaluation's) forwards: gradients zeroed, parameters current."""

    def forward_backward(self, step: int, comm: Any, on_backward: Callable[[], None], wait: Wait) -> Optional[torch.Tensor]:
        """The step's forwards and backwards and the gradients' reduction, waited on; the
        gradient norm where computing it is a collective (else None)."""

    def discard(self) -> None:
        """A step or an evaluation failed: let go of what it left (in-flight gradients, FSDP's per-iteration state)."""

    def divide(self, n: int) -> None:
        """The reduced gradients are sums over ``n`` micro-batches: make them the mean."""

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the reduced gradient (no collective)."""

    def clip(self, max_norm: float, norm: torch.Tensor) -> None: ...

    def stepped(self) -> None:
        """The optimizer stepped (or a state was loaded): parameters stepped elsewhere are stale."""

    def evaluate(self, batch: Any) -> Any:
        """The task's evaluate on this mode's model."""

    # ------------------------------------------------------------------ state
    def collect(self, step: int, extra: Dict[str, Any], shard: Optional[int]) -> Tuple[Entries, Dict[str, Any]]:
        """The state of ``step`` this rank holds (views, no copies) and its metadata."""

    def apply(self, entries: Entries, meta: Dict[str, Any], copy: bool, shard: Optional[int]) -> bool:
        """Load a state; True when it was this rank's own (the engine then applies its metadata)."""


class OneOptimizer:
    """The generation members of a strategy whose process steps one optimizer, its own rank's,
    and trains no lost rank's part (every mode but ZeRO, whose partition has parts)."""

    e: Any

    def take_rank(self, rank: int) -> None:
        pass

    def hold(self, ranks: Sequence[int]) -> None:
        pass

    def shards(self) -> List[int]:
        return []

    def parts(self) -> List[Tuple[torch.optim.Optimizer, Any]]:
        return [(self.e.optimizer, self.e.scheduler)]

    def scheduler_of(self, shard: Optional[int]) -> Any:
        return self.e.scheduler


def make(engine: Any) -> Strategy:
    """The strategy of ``engine``'s ``parallel.mode``."""
    mode = engine.mode
    if mode == "ddp":
        from .replicated import Replicated

        return Replicated(engine)
    if mode == "zero":
        from .zero import Zero

        return Zero(engine)
    if mode in ("fsdp", "hsdp"):
        from .fsdp_strategy import FSDPStrategy

        return FSDPStrategy(engine)
    if mode == "tp":
        from .tp import TPShardStrategy, TPStrategy

        return TPShardStrategy(engine) if int(engine.cfg.parallel.get("shard_size") or 1) > 1 else TPStrategy(engine)
    if mode == "pp":
        from .pp import PPStrategy

        return PPStrategy(engine)
    raise ValueError(f"parallel.mode={mode!r} has no strategy. HINT: use parallel=ddp|zero|fsdp|hsdp|tp|pp")
