"""The reference: the training a job's config describes, as a plain PyTorch loop in one process.

Nothing of the engine is used: no buckets, no communicator, no sharding. What is shared with the
framework is its contract, not its maths: the task (model, optimizer, scheduler, loss), the data
of (seed, step, rank, micro-batch) and the RNG seed of each forward (train/data.py). The rest is
written here from the documented semantics:

- the gradient of a step is the mean of the ``world x K`` micro-batch gradients (each micro-batch
  loss backpropagated on its own, the sum divided once);
- ``torch.nn.utils.clip_grad_norm_`` on that mean, after unscaling (fp16);
- ``torch.autocast`` for bf16 and fp16, ``torch.amp.GradScaler`` (its defaults) for fp16;
- the task's own scheduler stepped once per step, or the documented warm-up + cosine schedule;
- buffers (BatchNorm statistics) as torch DDP keeps them: rank 0's, from its own micro-batches;
  the other ranks' forwards start from the step's buffers and leave nothing behind.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch

from ckptless_hpc.train.data import StepBatches, forward_seed

AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def warmup_cosine(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """docs/configuration.md: linear warm-up to ``lr`` over ``warmup`` steps, cosine to ``lr x min_ratio``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * min_ratio + (lr - lr * min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def train(task: Any, cfg: Any) -> torch.nn.Module:
    """The model after ``cfg.train.steps`` steps of the job ``cfg`` describes."""
    t, o = cfg.train, cfg.optim
    world, k = int(cfg.cluster.nodes) * int(cfg.cluster.workers_per_node), int(t.grad_accum)
    torch.manual_seed(int(t.seed))
    model = task.build_model()
    opt = task.build_optimizer(model, o)
    own = getattr(task, "build_scheduler", None)
    sched = own(opt, o, int(t.steps)) if callable(own) else None
    scaler = torch.amp.GradScaler("cpu") if t.precision == "fp16" else None
    data = StepBatches(task, int(t.seed), world, k)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers()]
    for step in range(int(t.steps)):
        model.train()
        opt.zero_grad(set_to_none=False)
        start = [b.clone() for b in buffers]
        for rank in [*range(1, world), 0]:  # rank 0 last: its statistics are what remains
            for b, s in zip(buffers, start):
                b.copy_(s)
            for micro in range(k):
                batch = data.batch(step, micro, rank)
                forward_seed(int(t.seed), step, rank, micro)
                with torch.autocast("cpu", dtype=AMP[t.precision], enabled=AMP[t.precision] is not None):
                    loss = task.loss(model, batch)
                loss = loss[0] if isinstance(loss, tuple) else loss  # (loss, the task's own metrics)
                (scaler.scale(loss) if scaler is not None else loss).backward()
        for p in params:
            p.grad.div_(world * k)
        if scaler is not None:
            scaler.unscale_(opt)
        if t.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, float(t.clip_grad_norm))
        if sched is None:
            for g in opt.param_groups:
                g["lr"] = warmup_cosine(step, float(o.lr), int(o.warmup_steps), int(t.steps), float(o.min_lr_ratio))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
    return model


def max_differences(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Per tensor, the largest absolute difference relative to the tensor's largest magnitude."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    out = {}
    for k, w in want.items():
        g = got[k].to(w.dtype)
        assert g.shape == w.shape, (k, g.shape, w.shape)
        if w.is_floating_point():
            out[k] = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-12)
        else:
            out[k] = float((g != w).any())
    return out
