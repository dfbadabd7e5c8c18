"""``parallel=fsdp|hsdp`` in the engine: FSDP2 over each generation's group(s), bound once and
re-bound at every later generation (:mod:`.fsdp`), and this rank's shard as state.

The model is built (seeded, the same everywhere) with the engine and sharded when the process
first gets its rank and a group; the optimizer and the scheduler are built then, over the
sharded (DTensor) parameters. A state that arrives before that (a promoted spare fetches its
shard before the generation's group exists) is applied right after the sharding. A hot spare
pre-warms ``fully_shard`` on a private 1-rank group while it waits.

A step: FSDP2's all-gathers and reduce-scatters run inside forward and backward (synchronous:
a peer's death raises there); gradients are averaged over the ranks by FSDP (HSDP: over the
shard group, then across replicas by the all-reduce hook), and accumulated micro-batches are
reduced once, on the last (``set_requires_gradient_sync``). A failed step resets FSDP's
per-iteration state and drops the gradients; the failed generation's groups are released at once
(:func:`.fsdp.release_in_background`): a peer blocked with this rank in a group that did not
fail here (HSDP's cross-replica all-reduce) is released only when the group is destroyed.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import fsdp
from .evaluation import split_loss
from .grouped import LocalState, StepFailed, is_comm_error


class FSDPStrategy(LocalState):
    """``parallel=fsdp|hsdp`` (train/strategy.py; what it shares with tp and pp: train/grouped.py)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.binding: Optional[fsdp.FSDPBinding] = None
        self.warm: Dict[str, float] = {}

    @property
    def ready(self) -> bool:
        return self.binding is not None

    # ------------------------------------------------------------------ generations (sharded, and given its optimizer, at the first bind)
    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None:
        """hsdp: the generation's shard and replicate groups (train/fsdp.py), as ``comm.hsdp``."""
        e = self.e
        if e.mode != "hsdp":
            return
        shard_size = int(e.cfg.parallel.shard_size)
        comm.hsdp = fsdp.form_hsdp_groups(store, comm.gen, comm.rank, comm.world, shard_size, host, timeout_s, e.device, comm.backend)

    def let_go(self, comm: Any) -> bool:
        """FSDP's groups are destroyed at once, in a thread (a peer blocked with us in a group
        that did not fail here is released only then), after the binding lets go of them."""
        return self.release_groups(comm, self.binding.unbind() if self.binding is not None else [])

    # ------------------------------------------------------------------ set-up
    def shard_kwargs(self) -> Dict[str, Any]:
        """``fully_shard``'s options from the config: FSDP2's MixedPrecisionPolicy
        (parallel.param_dtype, parallel.reduce_dtype, as torchtitan sets them), when either is set."""
        p = self.e.cfg.parallel
        param, reduce = p.get("param_dtype"), p.get("reduce_dtype")
        if param is None and reduce is None:
            return {}
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=dt.get(param), reduce_dtype=dt.get(reduce))}

    def warm_up(self) -> Dict[str, float]:
        """A hot spare's throwaway shard + step (its real first ``fully_shard`` is then fast)."""
        e = self.e
        batch = e.feed.batches.batch(0, 0, 0)
        self.warm = fsdp.warm_up(
            e.task.build_model,
            lambda m: split_loss(e.task.loss(m, batch), e.task)[0],
            lambda m: e.task.build_optimizer(m, e.cfg.optim),
            units_fn=lambda m: fsdp.units_for(e.task, m),
            **self.shard_kwargs(),
        )
        return self.warm

    def groups(self, comm: Any) -> Tuple[Any, Any]:
        if self.e.mode == "hsdp":
            return comm.hsdp.shard, comm.hsdp.replicate
        return fsdp.register_group(comm), None

    def bind(self, comm: Any) -> None:
        e = self.e
        pg, rep = self.groups(comm)
        if self.binding is not None:
            self.binding.rebind(pg, rep)
            return
        fsdp.stable_default_group(comm.rank, comm.world)
        self.binding = fsdp.FSDPBinding.shard(e.model, pg, rep, units=fsdp.units_for(e.task, e.model), rank=comm.rank, **self.shard_kwargs())
        self.build_optimizer()

    # ------------------------------------------------------------------ one step
    def forward_backward(self, step: int, comm: Any, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> Optional[torch.Tensor]:
        """FSDP2's all-gathers and reduce-scatters run inside forward and backward; the loss's
        all-reduce and the buffers' broadcast are waited on, then the norm (a collective too:
        inside the step, which it can fail)."""
        futures = self._forward_backward(step, comm)
        on_backward()
        wait([comm.allreduce(self.e.reduction())] + futures)
        self._norm = self._collective_norm()
        return self._norm

    def _forward_backward(self, step: int, comm: Any) -> List[Any]:
        e = self.e
        assert self.binding is not None
        e.optimizer.zero_grad(set_to_none=True)
        k = e.micro_batches
        broadcasts: List[Any] = []
        try:
            for micro in range(k):
                batch = e.feed.get(step, micro)
                e.seed(step, comm.rank, micro)
                last = micro == k - 1
                self.binding.set_sync(last)
                with e.autocast():
                    loss = e.task_loss(batch)
                if last and e.buffers:
                    broadcasts = e.buffers.launch(comm)
                e.add_loss(loss)
                (loss / k if k > 1 else loss).backward()
        except Exception as err:
            if is_comm_error(err):
                raise StepFailed(f"step {step}: {err}") from None
            if "mixed torch.Tensor and DTensor" in str(err):
                raise RuntimeError(
                    f"{err}\nHINT: a parameter of an FSDP unit is used outside that unit's forward (e.g. a tied output head "
                    f"reusing the token embedding's weight): give {type(e.task).__name__} a shard_units(model) method returning "
                    "the modules to shard separately (e.g. the transformer blocks), leaving such modules to the root"
                ) from None
            raise
        return broadcasts

    def _collective_norm(self) -> torch.Tensor:
        assert self.binding is not None
        try:
            return self.binding.grad_norm()
        except Exception as err:
            if is_comm_error(err):
                raise StepFailed(f"gradient norm: {err}") from None
            raise

    def clip(self, max_norm: float, norm: torch.Tensor) -> None:
        assert self.binding is not None
        self.binding.clip(max_norm, norm)

    def evaluate(self, batch: Any) -> Any:
        """The task's evaluate on the sharded model; the root's parameters resharded after it:
        FSDP2 leaves them unsharded after a forward (a backward would gather them again), so a
        state collected after an evaluation (the final one, a copy, a spare's fetch) would name
        tensors the optimizer does not hold."""
        try:
            return super().evaluate(batch)
        finally:
            self.e.model.reshard()  # type: ignore[operator]

    def discard(self) -> None:
        if self.binding is not None:
            self.binding.reset()
