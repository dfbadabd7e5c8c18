"""Run a local job the way a requeued Slurm job starts: from a previous run's restart.json.

``python tests/e2e/drivers/resume_local.py RESTART_JSON [overrides...]`` is ``python -m
ckptless_hpc [overrides...]`` whose coordinator first restores RESTART_JSON (the emergency copy
to load, the excluded nodes, the faults fired), as ``SlurmJob.run_here`` does after a requeue.
The local backend has no resume option of its own; this is how the tests reach the read path.
"""

import json
import sys

from ckptless_hpc.coordinator.shell import Coordinator

with open(sys.argv[1], encoding="utf-8") as f:
    RESTART = json.load(f)
_run = Coordinator.run


async def _restored_run(self):
    self.restore(RESTART)
    return await _run(self)


Coordinator.run = _restored_run
sys.argv = ["ckptless_hpc", *sys.argv[2:]]
from ckptless_hpc.cli import main  # noqa: E402

main()
