"""The command lines a launcher starts, pinned (``launch/worker_argv.py``): the worker's, the
relay's, a node step's task, the zygote's, and the srun of a node's step in both control modes.

The interpreter's path varies between machines: it is written ``PYTHON`` in the golden file.
Regenerate with ``CKPTLESS_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_worker_argv.py``
and review the diff: a change here changes what ``ps``, the tools and Slurm see.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ckptless_hpc.launch import worker_argv as wa
from ckptless_hpc.launch.slurm import node_step_argv
from coordlib import cfg

pytestmark = pytest.mark.timeout(60)

GOLDEN = Path(__file__).parent / "golden" / "worker_argvs.json"


def _portable(argv):
    return ["PYTHON" if a == sys.executable else a for a in argv]


def rendered() -> dict:
    args = wa.worker_args("10.0.0.1:5000", "local3", "1", "127.0.0.1")
    relayed = wa.worker_args("10.0.0.1:5000", "local3", "0", "127.0.0.1", "/tmp/ckptless-relay-x/local3.sock")
    slurm, node = cfg("cluster=slurm", "cluster.workers_per_node=4"), cfg("cluster=slurm", "cluster.workers_per_node=4", "cluster.control=node")
    return {
        "worker": _portable(wa.worker_command(args)),
        "worker_relayed": _portable(wa.worker_command(relayed)),
        "relay": _portable(wa.relay_command("10.0.0.1:5000", "local3", "/tmp/ckptless-relay-x/local3.sock", str(0.5), "127.0.0.1")),
        "node_task": _portable(wa.node_task_command("10.0.0.1:5000", "n7", str(0.5), "127.0.0.1")),
        "zygote": _portable(wa.zygote_command("<room>")),
        "zygote_fake": _portable(wa.zygote_command("<room>", "fakeworker:main")),
        "srun_rank": _portable(node_step_argv(slurm, "n7", 4, "10.0.0.1:5000", "123", "/r/logs/n7.%t.log")),
        "srun_node": _portable(node_step_argv(node, "n7", 4, "10.0.0.1:5000", "123", "/r/logs/n7.%t.log")),
    }


def test_worker_argvs_golden():
    text = json.dumps(rendered(), indent=2) + "\n"
    if os.environ.get("CKPTLESS_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    expected = GOLDEN.read_text()
    assert text == expected, f"rendering differs from {GOLDEN}.\n--- golden\n{expected}\n--- now\n{text}\nHINT: if intended, regenerate with CKPTLESS_UPDATE_GOLDEN=1 and review the diff"


def test_the_node_task_passes_on_the_arguments_a_local_launcher_gives():
    """Under Slurm the node task becomes the worker or the relay: the arguments it passes on are
    the local launcher's, so both backends start the same worker."""
    assert wa.worker_args("c:1", "n", "2", "h", "/s") == ["--coordinator", "c:1", "--node", "n", "--local-index", "2", "--host", "h", "--relay", "/s"]
    assert wa.worker_args("c:1", "n", wa.SLURM_INDEX, "h") == ["--coordinator", "c:1", "--node", "n", "--local-index", "slurm", "--host", "h"]
