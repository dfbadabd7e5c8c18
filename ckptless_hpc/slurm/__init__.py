"""Thin Slurm layer: all of the project's Slurm I/O lives in this package.

* `env`: `SlurmEnvironment`, the one reader of ``SLURM_*`` variables; node-list
  expansion and compression (pure).
* `render`: `SlurmShape` and the sbatch/srun/scontrol argv rendered from it (pure).
* `commands`: subprocess wrappers with timeouts (squeue, scontrol, sinfo).
"""

from ckptless_hpc.slurm.env import SlurmEnvironment, compress_nodelist, expand_nodelist
from ckptless_hpc.slurm.render import SlurmShape, sbatch_header, sbatch_parameters, srun_worker_argv

__all__ = [
    "SlurmEnvironment",
    "SlurmShape",
    "compress_nodelist",
    "expand_nodelist",
    "sbatch_header",
    "sbatch_parameters",
    "srun_worker_argv",
]
