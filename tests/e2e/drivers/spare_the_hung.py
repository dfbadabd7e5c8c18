"""Run a local job whose coordinator cannot kill a hung worker: the first kill it orders for a
stopped (SIGSTOP) process is refused, so the process stays frozen with every socket open.

``python tests/e2e/drivers/spare_the_hung.py KILLS_JSONL [overrides...]`` is ``python -m
ckptless_hpc [overrides...]``; every kill the coordinator orders is written to KILLS_JSONL with
its time, the worker, its pid, the process state and whether it was carried out. Later kills
of the same worker (at shutdown) are carried out. With the kill refused, nothing but the
coordinator's abort can release the survivors blocked in a collective with the frozen peer.
"""

import json
import sys
import time

from ckptless_hpc.launch.local import LocalLauncher

LOG = sys.argv[1]
_kill = LocalLauncher.kill_worker
_refused = set()


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


def _kill_unless_frozen(self, worker):
    pid = self.pid(worker)
    state = _state(pid) if pid else None
    refuse = state == "T" and worker not in _refused
    if refuse:
        _refused.add(worker)
    with open(LOG, "a") as f:
        f.write(json.dumps({"time": time.time(), "worker": worker, "pid": pid, "state": state, "killed": not refuse}) + "\n")
    if not refuse:
        _kill(self, worker)


LocalLauncher.kill_worker = _kill_unless_frozen
sys.argv = ["ckptless_hpc", *sys.argv[2:]]
from ckptless_hpc.cli import main  # noqa: E402

main()
