"""``python -m bench.b7_coord``: B7's coordinator process, the real ``Coordinator`` class.

Its launcher starts no processes: the simulated ranks (``bench/b7_ranks.py``) connect by
themselves once the address file exists. Everything else (handshake, membership, watchdog,
recovery, events.jsonl, summary.json) is the coordinator a job runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from hydra import compose, initialize_config_module

from ckptless_hpc.config import register_configs, validate
from ckptless_hpc.coordinator.shell import Coordinator
from ckptless_hpc.launch.probes import PROBES
from ckptless_hpc.launch.run import setup_logging
from ckptless_hpc.metrics import DelayHistogram
from ckptless_hpc.control.wire import load_secret


class SimLauncher:
    """Nodes named ``sim<i>``; starting one only publishes the coordinator's address. Every
    member of ``ckptless_hpc.launch.base.Launcher``; no scheduler, no process to measure."""

    batch_node: Optional[str] = None
    node_is_one_step = False
    measures_identity = False

    def __init__(self, nodes: int, spare_nodes: int, address_file: str) -> None:
        self.nodes, self.spare_nodes, self.address_file = nodes, spare_nodes, address_file
        self.killed: List[str] = []

    def initial_nodes(self, excluded: Any = ()) -> Tuple[List[str], List[str]]:
        return [f"sim{i}" for i in range(self.nodes)], [f"sim{self.nodes + i}" for i in range(self.spare_nodes)]

    async def start_node(self, name: str, workers: int, coordinator: str, on_exit: Any) -> List[str]:
        if not os.path.exists(self.address_file):
            tmp = self.address_file + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"address": coordinator, "pid": os.getpid()}, f)
            os.replace(tmp, self.address_file)
        return [f"{name}.{j}" for j in range(workers)]

    def register(self, worker: str, hello: Dict[str, Any]) -> None:
        pass

    def exclude_node(self, node: str, why: str) -> None:
        pass

    def drained_nodes(self, nodes: List[str]) -> List[str]:
        return []

    def hold_commands(self) -> None:
        pass

    def release_commands(self) -> None:
        pass

    def launched_identity(self, worker: str) -> None:
        return None

    def live_identity(self, worker: str) -> None:
        return None

    def requeue(self, reason: str) -> Optional[str]:
        return "the B7 launcher has no scheduler"

    def free_node(self) -> Optional[str]:
        return None

    def log_path(self, worker: str) -> str:
        return os.devnull

    def kill_worker(self, worker: str) -> None:
        self.killed.append(worker)

    async def shutdown(self, timeout_s: float) -> None:
        pass


class GcPauses:
    """gc.callbacks: how many collections, how long in all, the longest (seconds)."""

    def __init__(self) -> None:
        self.t0, self.n, self.total_s, self.max_s = 0.0, 0, 0.0, 0.0

    def __call__(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            d = time.perf_counter() - self.t0
            self.n, self.total_s, self.max_s = self.n + 1, self.total_s + d, max(self.max_s, d)

    def take(self) -> Dict[str, Any]:
        out = {"collections": self.n, "total_s": round(self.total_s, 4), "max_s": round(self.max_s, 4)}
        self.n, self.total_s, self.max_s = 0, 0.0, 0.0
        return out


def config(nodes: int, wpn: int, spare_nodes: int, interval_s: float, timeout_s: float, control: str = "rank") -> Any:
    register_configs()
    overrides = [
        "task=mlp", f"cluster.nodes={nodes}", f"cluster.workers_per_node={wpn}", f"cluster.spare_nodes={spare_nodes}",
        "cluster.refill_spares=false", f"cluster.heartbeat_interval_s={interval_s}", f"cluster.heartbeat_timeout_s={timeout_s}",
        "train.steps=100000000", "train.save_final=false", "train.console_rank=null", "train.log_every=1000", "cluster.startup_timeout_s=300", f"cluster.control={control}",
    ]
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    validate(cfg, PROBES)
    return cfg


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.b7_coord")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--wpn", type=int, required=True)
    ap.add_argument("--spare-nodes", type=int, default=1)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--control", choices=("rank", "node"), default="rank")
    a = ap.parse_args(argv)
    os.makedirs(a.run_dir, exist_ok=True)
    cfg = config(a.nodes, a.wpn, a.spare_nodes, a.interval, a.timeout, a.control)
    import torch.distributed  # noqa: F401  the store's import, done before ranks connect (srun of real nodes takes longer)
    job_id = "b7"
    context = setup_logging(a.run_dir, job_id)
    launcher = SimLauncher(a.nodes, a.spare_nodes, os.path.join(a.run_dir, "address.json"))
    coord = context.coordinator = Coordinator.from_config(cfg, a.run_dir, launcher, load_secret(), job_id)

    marks: List[Dict[str, Any]] = []
    gc_pauses = GcPauses()
    gc.callbacks.append(gc_pauses)

    def mark() -> None:
        """SIGUSR2: the heartbeat delays (and GC pauses) so far are one phase of the run; start the next."""
        marks.append(dict(coord.hb_delay.report(), gc=gc_pauses.take()))
        coord.health.hb_delay = coord.control.hb_delay = DelayHistogram()  # the server adds to it, the summary reads it

    async def run() -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, coord.request_cancel, "B7 over (SIGTERM)")
        loop.add_signal_handler(signal.SIGUSR2, mark)
        return await coord.run()

    code = asyncio.run(run())
    with open(os.path.join(a.run_dir, "b7_marks.json"), "w", encoding="utf-8") as f:
        json.dump(marks, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
