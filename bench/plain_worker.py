"""A plain data-parallel worker: the baselines of B1, B3 and B6.

The same task, model, optimizer, LR schedule and per-step seeding as a ckptless_hpc worker,
but trained the traditional way: torch ``DistributedDataParallel`` over one gloo process
group, optionally saving a checkpoint (model + optimizer + step) with ``torch.save`` every K
steps and loading the newest one at start. Nothing here survives a failure: the harness
(``bench/ckpt_restart.py``) stops every process and starts them all again.

Each rank appends JSONL events to ``--events`` (time is ``time.time()``):
``ready`` (group formed, checkpoint loaded), ``step`` (rank 0: a committed step; ``step`` is
the number of committed steps, as in ckptless_hpc's events), ``ckpt_saved``, ``fault``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Dict, List

T_START = time.time()  # before torch is imported: the process start cost is part of a restart

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.worker_lib import Events, build_lm  # noqa: E402




def save_checkpoint(path: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Write the state durably (tmp file, fsync, atomic rename): what a real checkpoint costs."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.plain_worker", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of the harness's TCPStore")
    p.add_argument("--prefix", required=True, help="store prefix of this attempt (one per restart)")
    p.add_argument("--task", required=True, help="LMTask arguments as JSON")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default="", help="checkpoint file (empty: never checkpoint)")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--faults", default="[]", help='JSON [{"index": i, "rank": r, "step": s}, ...] still to fire')
    p.add_argument("--events", required=True)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the model on GPU 0, DDP over gloo")
    args = p.parse_args(argv)

    from ckptless_hpc.tasks.base import seed_step, set_lr

    ev = Events(args.events)
    ev.emit("imported", process_start=T_START)
    task, model, opt, optim_cfg = build_lm(args.task, args.seed, args.device)
    ev.emit("built")

    host, _, port = args.store.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(args.prefix, store), rank=args.rank, world_size=args.world, timeout=timedelta(seconds=120))
    ev.emit("group")
    start = 0
    load_s = 0.0
    if args.ckpt and os.path.exists(args.ckpt):
        t0 = time.time()
        ck = torch.load(args.ckpt, map_location=args.device, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        start = int(ck["step"])
        load_s = time.time() - t0
        del ck
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    faults: List[Dict[str, int]] = [f for f in json.loads(args.faults) if f["rank"] == args.rank]
    dist.barrier()
    ev.emit("ready", rank=args.rank, step=start, load_s=load_s)

    for step in range(start, args.steps):
        t0 = time.perf_counter()
        batch = task.batch(step, args.rank, args.world, seed_step(args.seed, step, args.rank))
        opt.zero_grad(set_to_none=False)
        loss = task.loss(ddp, batch)
        for f in faults:
            if f["step"] == step:  # peers are about to block in the backward allreduce
                ev.emit("fault", rank=args.rank, step=step, index=f["index"])
                os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()  # DDP overlaps the gradient allreduce with the backward pass
        set_lr(opt, optim_cfg, step, args.steps)
        opt.step()
        step_s = time.perf_counter() - t0
        if args.rank == 0:
            ev.emit("step", step=step + 1, step_s=step_s, loss=float(loss.detach()))
            if args.ckpt and args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
                t1 = time.time()
                save_checkpoint(args.ckpt, step + 1, model, opt)
                ev.emit("ckpt_saved", step=step + 1, save_s=time.time() - t1)
    dist.barrier()
    ev.emit("done", rank=args.rank)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads); every event is already flushed


if __name__ == "__main__":
    main()
