"""Examples of bringing your own model to ckptless_hpc (see docs/tasks.md).

Run from the repository root (the worker processes import ``examples.*`` from the current
directory), or put the repository on PYTHONPATH.
"""
