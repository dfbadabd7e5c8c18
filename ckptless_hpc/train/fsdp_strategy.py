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
from ..state.snapshot import Entries, plain_meta
from .evaluation import split_loss
from .strategy import OneOptimizer


class StepFailed(RuntimeError):
    """A collective inside FSDP's forward/backward failed (a peer died or its group was released)."""


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in ("gloo", "Gloo", "Connection closed", "Connection reset", "NCCL", "no group"))


class FSDPStrategy(OneOptimizer):
    """``parallel=fsdp|hsdp`` (train/strategy.py)."""

    sharded = True

    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.binding: Optional[fsdp.FSDPBinding] = None
        self._pending: Optional[Tuple[Entries, Dict[str, Any]]] = None
        self._norm: Optional[torch.Tensor] = None
        self.warm: Dict[str, float] = {}

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
        that did not fail here is released only then)."""
        self.e.comm = None
        fsdp.release_in_background(self.release(comm))
        return True

    def layout(self) -> Dict[str, int]:
        return {"buckets": 0}  # FSDP2 reduces its own gradients

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
        e.optimizer = e.task.build_optimizer(e.model, e.cfg.optim)
        e.scheduler = e.build_scheduler()
        if self._pending is not None:
            entries, meta = self._pending
            self._pending = None
            self.apply(entries, meta)
            e.apply_meta(meta)

    def release(self, comm: Any) -> List[Any]:
        """What the failed generation holds, for release_in_background (nothing may keep it)."""
        objs = self.binding.unbind() if self.binding is not None else []
        objs.append(comm)
        hs = getattr(comm, "hsdp", None)
        if hs is not None:
            objs += hs.groups()
            comm.hsdp = None
        return objs

    # ------------------------------------------------------------------ one step
    def begin(self, comm: Any, wait: Callable[[List[Any]], None]) -> None:
        self._norm = None

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
            if _is_comm_error(err):
                raise StepFailed(f"step {step}: {err}") from None
            if "mixed torch.Tensor and DTensor" in str(err):
                raise RuntimeError(
                    f"{err}\nHINT: a parameter of an FSDP unit is used outside that unit's forward (e.g. a tied output head "
                    f"reusing the token embedding's weight): give {type(e.task).__name__} a shard_units(model) method returning "
                    "the modules to shard separately (e.g. the transformer blocks), leaving such modules to the root"
                ) from None
            raise
        return broadcasts

    def evaluate(self, batch: Any) -> Any:
        return evaluate_sharded(self.e, batch)

    def divide(self, n: int) -> None:
        pass  # FSDP has averaged over the ranks (and the micro-batches: loss / K)

    def grad_norm(self) -> torch.Tensor:
        assert self._norm is not None, "the norm is computed inside the step (forward_backward)"
        return self._norm

    def stepped(self) -> None:
        pass

    def _collective_norm(self) -> torch.Tensor:
        assert self.binding is not None
        try:
            return self.binding.grad_norm()
        except Exception as err:
            if _is_comm_error(err):
                raise StepFailed(f"gradient norm: {err}") from None
            raise

    def clip(self, max_norm: float, norm: torch.Tensor) -> None:
        assert self.binding is not None
        self.binding.clip(max_norm, norm)

    def discard(self) -> None:
        if self.binding is not None:
            self.binding.reset()

    # ------------------------------------------------------------------ state
    def collect(self, step: int, extra: Dict[str, Any], shard: Optional[int] = None) -> Tuple[Entries, Dict[str, Any]]:
        return collect_local(self.e, step, extra, with_optimizer=self.binding is not None)

    def apply(self, entries: Entries, meta: Dict[str, Any], copy: bool = False, shard: Optional[int] = None) -> bool:
        """Copied in place (nothing is aliased, ``copy`` or not); False while the model is not yet
        sharded (a promoted spare: applied, with its metadata, at its first bind)."""
        if self.binding is None:
            self._pending = (entries, meta)
            return False
        apply_local(self.e, entries, meta)
        return True


def evaluate_sharded(e: Any, batch: Any) -> Any:
    """The task's evaluate on a model whose forward runs collectives (FSDP2's all-gathers, tensor
    parallel's): a failed one raises as in a step (``StepFailed``)."""
    try:
        return e.task.evaluate(e.run_model, batch)
    except Exception as err:
        if _is_comm_error(err):
            raise StepFailed(f"evaluation: {err}") from None
        raise


def collect_local(e: Any, step: int, extra: Dict[str, Any], with_optimizer: bool) -> Tuple[Entries, Dict[str, Any]]:
    """A rank's local state (fsdp, hsdp and tp, whose parameters are DTensors; pp, a stage's): its local
    tensors (:func:`.fsdp.own_entries`), the task's tensors, and in the metadata the optimizer's
    hyper-parameters, its parameters by name (state/dcp.py) and the task's scalars."""
    entries = fsdp.own_entries(e.model, e.optimizer if with_optimizer else None)
    task_scalars: Dict[str, Any] = {}
    for k, v in sorted((e.task.state_dict() or {}).items()):
        if torch.is_tensor(v):
            entries.append((f"task/{k}", v))
        else:
            task_scalars[k] = v
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in e.optimizer.param_groups]
    name_of = {id(p): n for n, p in e.model.named_parameters()}
    groups = [[name_of[id(p)] for p in g["params"]] for g in e.optimizer.param_groups]
    meta = {"step": step, "hyper": hyper, "groups": groups, "task_scalars": task_scalars, **extra}
    return entries, plain_meta(meta)


def apply_local(e: Any, entries: Entries, meta: Dict[str, Any]) -> None:
    """What :func:`collect_local` gave, copied in place into this rank's tensors, task and
    optimizer hyper-parameters (checked before anything is written: :func:`.fsdp.load_own`)."""
    fsdp.load_own(e.model, e.optimizer, [(n, t) for n, t in entries if not n.startswith("task/")])
    task_sd: Dict[str, Any] = dict(meta.get("task_scalars", {}))
    task_sd.update({n[len("task/") :]: t for n, t in entries if n.startswith("task/")})
    if task_sd:
        e.task.load_state_dict(task_sd)
    for g, h in zip(e.optimizer.param_groups, meta.get("hyper", [])):
        for k, v in h.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
