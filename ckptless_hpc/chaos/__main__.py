"""``python -m ckptless_hpc.chaos``: random fault schedules against the oracle (local.py; Slurm: slurm.py)."""

import sys

from .local import main

sys.exit(main())
