"""Benchmarks of ckptless_hpc (issue 5): ``python -m bench [--quick]``. Not timed tests."""
