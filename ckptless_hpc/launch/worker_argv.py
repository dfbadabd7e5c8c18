"""One rendering of the command lines a launcher starts: a worker's, a node's relay's, a Slurm
node step's task (``launch/node_task.py``) and the local zygote's.

Why one place: the same arguments were spelled by the local launcher, the Slurm launcher, the
node task (which passes them on to the worker and the relay it becomes) and the zygote (whose
forked worker retitles itself as the worker's command line, so that ``ps`` and the tools see
what an exec'd worker showed). Pure text: no process is started here, and the golden test
(tests/unit/test_worker_argv.py) pins every rendering.

The zygote (``worker/zygote.py``) sits below this layer and cannot import it: it spells the
worker's title itself, and ``test_zygote.py`` checks that title against ``worker_command``.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

WORKER_MODULE = "ckptless_hpc.worker"
RELAY_MODULE = "ckptless_hpc.control.relay"
NODE_TASK_MODULE = "ckptless_hpc.launch.node_task"
ZYGOTE_MODULE = "ckptless_hpc.worker.zygote"
SLURM_INDEX = "slurm"  # a worker's --local-index inside a node's srun step: its SLURM_PROCID


def python_m(module: str, args: Sequence[str], python: Optional[str] = None) -> List[str]:
    """``python -m module args...`` with this interpreter (``python``: another one's path)."""
    return [python or sys.executable, "-m", module, *args]


def worker_args(coordinator: str, node: str, index: str, host: str, relay: Optional[str] = None) -> List[str]:
    """A worker's arguments: its coordinator (HOST:PORT), node, index on the node (or
    ``SLURM_INDEX``), the address it binds, and its node's relay socket under cluster.control=node."""
    return ["--coordinator", coordinator, "--node", node, "--local-index", index, "--host", host, *(["--relay", relay] if relay else [])]


def worker_command(args: Sequence[str]) -> List[str]:
    """The command line of an exec'd worker (and the title a forked one takes)."""
    return python_m(WORKER_MODULE, args)


def relay_args(coordinator: str, node: str, path: str, interval: str, host: str) -> List[str]:
    """A node relay's arguments: its socket ``path`` and the summaries' ``interval`` (seconds, as text)."""
    return ["--coordinator", coordinator, "--node", node, "--path", path, "--interval", interval, "--host", host]


def relay_command(coordinator: str, node: str, path: str, interval: str, host: str) -> List[str]:
    return python_m(RELAY_MODULE, relay_args(coordinator, node, path, interval, host))


def node_task_command(coordinator: str, node: str, interval: str, host: str) -> List[str]:
    """One task of a node's srun step under cluster.control=node: it becomes the node's relay or
    one of its workers, from SLURM_PROCID (the relay's socket path is worked out on the node)."""
    return python_m(NODE_TASK_MODULE, ["--coordinator", coordinator, "--node", node, "--interval", interval, "--host", host])


def zygote_command(room: str, target: Optional[str] = None) -> List[str]:
    """The local zygote: ``target`` (the tests' fake worker) and, last, ``room``: blank space in
    its argv area for a forked worker's title."""
    return python_m(ZYGOTE_MODULE, [*(["--target", target] if target else []), room])
