"""ckptless_hpc: checkpointless training on Slurm (hot spares, peer-to-peer recovery)."""

__version__ = "0.1.0"
