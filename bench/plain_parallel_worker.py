"""A plain tensor- or pipeline-parallel worker: the baseline of the parallel bench section (bench/parallel_bench.py).

The same task (``examples.llama.LlamaParallelTask`` of the same sizes), the same seeded model,
AdamW, LR schedule and batches as a ckptless_hpc worker of ``parallel=tp`` or ``parallel=pp``,
trained the way a torch user writes it, with no fault tolerance: one gloo process group, a
``(dp, tp)`` or ``(dp, pp)`` device mesh (rank ``r`` is data rank ``r // 2``), then

- tp: ``parallelize_module(model, mesh["tp"], task.tp_plan(model))``; per step the batch of the
  rank's data rank, forward, backward, each parameter's local gradient all-reduced over
  ``mesh["dp"]`` and divided by the data world, ``opt.step()``;
- pp: ``PipelineStage`` of ``task.pp_stage(model, stage, 2)`` on ``mesh["pp"]`` and
  ``ScheduleGPipe`` over ``--micro`` micro-batches (``scale_grads=False``); per step the first
  stage feeds the joined micro-batches, the last computes their losses; the gradients
  all-reduced over ``mesh["dp"]`` and divided by data world x micro-batches, ``opt.step()``;
- both: before ``opt.step()``, the gradients clipped to ``--clip`` as torchtitan's
  ``clip_grad_norm_`` does it (its default ``max_norm``, 1.0): torch's ``get_total_norm`` of the
  local gradients (a DTensor norm made whole with ``full_tensor()``; pp: squared, summed over
  ``mesh["pp"]``), then each local gradient scaled by ``clip_grads_with_norm_``'s coefficient; 0 turns it off.

The divisors and the batches are ckptless_hpc's (ckptless_hpc/train/tp.py, pp.py, data.py), so
both train the same thing; what ckptless_hpc adds (its loss all-reduce, the global norm, the
heartbeats, the state it keeps servable) is the overhead the section measures.

Events (JSONL, ``--events``; time is ``time.time()``): ``ready`` (every rank: mesh formed,
model parallelized), ``step`` (rank 0: a committed step, ``step`` the number of committed
steps, as in ckptless_hpc's events), ``final_loss`` (rank 0: the mean loss of the last step over
the global batch, as ckptless_hpc's summary reports it; one all-reduce after the last step's event).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from bench.worker_lib import Events

MODES = ("tp", "pp")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: written in place), a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def build(task_json: str, seed: int) -> Tuple[Any, torch.nn.Module, Any]:
    """The task and its whole model, seeded as a ckptless_hpc worker seeds it (``torch.manual_seed(train.seed)`` before ``build_model``)."""
    from examples.llama import LlamaParallelTask
    from ckptless_hpc.config import OptimConfig

    torch.set_num_threads(1)  # as the job's workers (train.threads=1)
    task = LlamaParallelTask(**json.loads(task_json))
    torch.manual_seed(seed)
    return task, task.build_model(), OptimConfig()


BUCKET_BYTES = 16 << 20  # DDP's default bucket (and the jobs' train.bucket_mb): a fair baseline sums in buckets, not per tensor


def reduce_grads(params: List[torch.nn.Parameter], group: Any, divisor: int) -> None:
    """The local gradients summed over the data-parallel group in flat buckets of at most
    BUCKET_BYTES (as DDP does; the buckets are cut as the jobs cut theirs, grouped.gradient_buckets),
    then divided into the mean over the global batch."""
    from ckptless_hpc.train.grouped import gradient_buckets

    for bucket in gradient_buckets([_local(p.grad) for p in params if p.grad is not None], BUCKET_BYTES):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        for g, v in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(v.view_as(g))


def clip(params: List[torch.nn.Parameter], max_norm: float, pp_group: Any = None) -> torch.Tensor:
    """The gradients clipped to ``max_norm`` by their global L2 norm, as torchtitan's
    ``dist_utils.clip_grad_norm_`` computes it (DTensor norms made whole; pp: the stages' squares
    summed over the pipeline group); returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    # tp: the planned modules' gradients are DTensors, the rest plain tensors; torch's foreach
    # kernels take one kind at a time, so each kind's norm is taken apart and the two combined
    dtensors = [g for g in grads if callable(getattr(g, "full_tensor", None))]
    norms = [torch.nn.utils.get_total_norm(dtensors, 2.0, foreach=True).full_tensor()] if dtensors else []
    plain = [g for g in grads if not callable(getattr(g, "full_tensor", None))]
    norms += [torch.nn.utils.get_total_norm(plain, 2.0, foreach=True)] if plain else []
    total = torch.linalg.vector_norm(torch.stack(norms))
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total**0.5
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s, on the local parts
    torch._foreach_mul_([_local(g) for g in grads], coef)
    return total


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.plain_parallel_worker", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="ranks in all: 2 x the data world (tp=2 or pp=2)")
    p.add_argument("--store", required=True, help="HOST:PORT of the harness's TCPStore")
    p.add_argument("--prefix", required=True, help="store prefix of this run")
    p.add_argument("--task", required=True, help="LlamaParallelTask arguments as JSON")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--micro", type=int, default=4, help="pp: micro-batches per step (ckptless_hpc's train.grad_accum)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0, help="max_norm of the gradients' clipping (torchtitan's default, 1.0; ckptless_hpc's train.clip_grad_norm); 0: none")
    p.add_argument("--events", required=True)
    p.add_argument("--gate", help="stop at bench/gate.py's gate at this path after each step (python -m bench.parallel_bench --interleave)")
    args = p.parse_args(argv)
    if args.world % 2:
        raise SystemExit(f"--world={args.world}: must be even (2 ranks per replica). HINT: --world 4 for 2 replicas of tp=2 or pp=2")

    from torch.distributed.device_mesh import init_device_mesh

    from ckptless_hpc.tasks.base import seed_step, set_lr

    ev = Events(args.events)
    task, model, optim_cfg = build(args.task, args.seed)
    host, _, port = args.store.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(args.prefix, store), rank=args.rank, world_size=args.world, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (args.world // 2, 2), mesh_dim_names=("dp", args.mode))
    dp_rank, dp_world, inner = args.rank // 2, args.world // 2, args.rank % 2
    dp_group = mesh["dp"].get_group()

    if args.mode == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], task.tp_plan(model), src_data_rank=None)
        module, schedule, micro = model, None, 1
    else:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        module = task.pp_stage(model, inner, 2)
        stage = PipelineStage(module, inner, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=args.micro, loss_fn=task.pp_loss, scale_grads=False)
        micro = args.micro
    opt = task.build_optimizer(module, optim_cfg)
    params = list(module.parameters())
    dist.barrier()
    ev.emit("ready", rank=args.rank)

    gate = None
    if args.gate:
        from bench.gate import Gate

        gate = Gate(args.gate)
    local_loss = torch.zeros((), dtype=torch.float64)
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if schedule is None:
            batch = task.batch(step, dp_rank, dp_world, seed_step(args.seed, step, dp_rank))
            loss = task.loss(module, batch)
            loss.backward()
            local_loss = loss.detach().to(torch.float64)
        else:
            # micro-batch m of data rank d is ckptless_hpc's virtual rank d*micro + m of world dp_world*micro (train/data.py)
            vranks = [dp_rank * micro + m for m in range(micro)]
            xs, ys = zip(*(task.pp_split(task.batch(step, v, dp_world * micro, seed_step(args.seed, step, v))) for v in vranks))
            losses: List[torch.Tensor] = []
            if inner == 0:
                schedule.step(torch.cat(xs))
            else:
                schedule.step(target=torch.cat(ys), losses=losses)
                local_loss = torch.stack([x.detach() for x in losses]).to(torch.float64).mean()
        reduce_grads(params, dp_group, dp_world * micro)
        if args.clip > 0:
            clip(params, args.clip, None if schedule is None else mesh["pp"].get_group())
        set_lr(opt, optim_cfg, step, args.steps)
        opt.step()
        if args.rank == 0:
            ev.emit("step", step=step + 1, step_s=time.perf_counter() - t0)
        if gate is not None:
            gate.at_step_end(step + 1)
    # the last step's loss over the global batch: each TP rank holds its replica's, each last stage its replica's
    contributors = args.world if schedule is None else dp_world
    dist.all_reduce(local_loss)
    if args.rank == 0:
        ev.emit("final_loss", loss=float(local_loss) / contributors)
    dist.barrier()
    ev.emit("done", rank=args.rank)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads); every event is already flushed


if __name__ == "__main__":
    main()
