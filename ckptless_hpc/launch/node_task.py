"""``python -m ckptless_hpc.launch.node_task``: one task of a node's srun step under
``cluster.control=node``. The step has ``workers_per_node + 1`` tasks: the last
(``SLURM_PROCID == SLURM_NTASKS - 1``) is the node's relay (``ckptless_hpc.control.relay``, no torch),
the others are the workers, local index = ``SLURM_PROCID``, connected through it.

The relay's socket is node-local: its path is worked out here, on the node (its temp dir), from
the job's secret and the node, the same for every task of the step and never on a command line
(relay.socket_path: another user of the node cannot guess it).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..control.wire import load_secret
from ..control.relay import socket_path
from ..slurm.env import SlurmEnvironment
from .worker_argv import relay_args, worker_args


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptless_hpc.launch.node_task", description=__doc__)
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator's control server")
    p.add_argument("--node", required=True)
    p.add_argument("--interval", type=float, required=True, help="cluster.heartbeat_interval_s (the relay's summaries)")
    p.add_argument("--host", default="auto")
    a = p.parse_args(argv)
    env = SlurmEnvironment()
    procid, ntasks = env.procid, env.ntasks
    if procid is None or not ntasks or ntasks < 2:
        p.error(f"expects to be a task of a node's srun step with workers_per_node + 1 tasks (SLURM_PROCID={procid}, SLURM_NTASKS={ntasks})")
    path = socket_path(load_secret(), a.node)
    if procid == ntasks - 1:
        from ..control import relay

        return relay.main(relay_args(a.coordinator, a.node, path, str(a.interval), a.host))
    from ..worker import runtime

    runtime.main(worker_args(a.coordinator, a.node, str(procid), a.host, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
