"""Hydra configs shipped in the wheel as ckptless_hpc.conf."""
