"""One TorchFT replica (a replica group of one rank) training the same task: B2's contender.

TorchFT (pytorch/torchft) as its README wires it: a Lighthouse (run by the harness), one
``Manager`` per replica group with its own TCPStore, ``torchft.ProcessGroupGloo``,
``torchft.DistributedDataParallel`` and ``torchft.Optimizer``. A replica that dies is
restarted as a new process by the harness (as torchelastic would); the Manager heals it from
a live peer (HTTP checkpoint transport, TorchFT's default). Same model, optimizer, LR schedule
and per-step seeding as a ckptless_hpc worker; same JSONL events as ``bench.plain_worker``
(``step`` is the number of committed steps).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any, List

T_START = time.time()

import torch.distributed as dist  # noqa: E402

from bench.worker_lib import Events, build_lm  # noqa: E402




def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.torchft_worker", description=__doc__.splitlines()[0])
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--task", required=True, help="LMTask arguments as JSON")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-step", type=int, default=-1, help="SIGKILL itself while computing this step")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--events", required=True)
    args = p.parse_args(argv)

    import torchft
    from ckptless_hpc.tasks.base import seed_step, set_lr

    ev = Events(args.events)
    ev.emit("imported", process_start=T_START)
    task, model, opt, optim_cfg = build_lm(args.task, args.seed)
    ev.emit("built")

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout_s)

    def load_state_dict(sd: Any) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict() -> Any:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.replicas,  # fixed world size: the survivors wait for the replacement
        replica_id=f"bench_{args.replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    ft_opt = torchft.Optimizer(manager, opt)
    ev.emit("ready", replica=args.replica)

    fired = False
    while manager.current_step() < args.steps:
        step = manager.current_step()
        t0 = time.perf_counter()
        ft_opt.zero_grad(set_to_none=False)  # starts the quorum (heals a replacement)
        batch = task.batch(step, args.replica, args.replicas, seed_step(args.seed, step, args.replica))
        loss = task.loss(ddp, batch)
        if step == args.fault_step and not fired:
            ev.emit("fault", replica=args.replica, step=step, index=0)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        set_lr(opt, optim_cfg, step, args.steps)
        ft_opt.step()  # steps the optimizer only if every replica's allreduce succeeded
        if manager.current_step() > step:
            ev.emit("step", replica=args.replica, step=manager.current_step(), step_s=time.perf_counter() - t0, loss=float(loss.detach()))
    ev.emit("done", replica=args.replica)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
