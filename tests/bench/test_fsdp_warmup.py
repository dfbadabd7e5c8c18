"""A hot spare's FSDP2 warm-up (``ckptless_hpc.train.fsdp.warm_up``) leaves no trace, and the
bench section that measures what it buys (``python -m bench --only fsdp_warmup``,
bench/fsdp_warmup.py) works.

What the warm-up buys is a time, quoted in docs/sharding.md from
``bench/results/only-fsdp_warmup.json`` and checked there by ``python -m bench --check``: never
asserted here (a loaded machine moves it). What is asserted: a process that warmed up trains its
first real step to the same bits as a cold one (the throwaway mesh, group and DTensor caches are
gone), in fresh processes, cold and warm alternated as the bench runs them.
"""

from __future__ import annotations

import pytest

from bench import fsdp_warmup

pytestmark = pytest.mark.timeout(600)


def test_a_warmed_process_trains_its_first_step_to_the_bits_of_a_cold_one():
    res = fsdp_warmup.measure(reps=1)
    cold, warm = res["samples"]["cold"][0], res["samples"]["warm"][0]
    assert cold["warm_up"] is None and set(warm["warm_up"]) == {"setup_s", "fully_shard_s", "step_s", "total_s"}, warm
    assert warm["params_sha256"] == cold["params_sha256"] and res["same_result"], res["samples"]
    for mode in ("cold", "warm"):  # each figure the page quotes is there, with its spread
        assert set(res[mode]) >= {"shard_s", "first_step_s", "rebind_first_s", "rebind_median_s"}, res[mode]
        assert all(set(v) == {"median", "min", "max"} for v in res[mode].values()), res[mode]
    assert res["shard_cold_over_warm"] > 0 and "x" in fsdp_warmup.one_line(res)
