"""The tensor- and pipeline-parallel bench section (bench/parallel_bench.py, issue 31's "Measured") runs and writes every field.

``python -m bench.parallel_bench --quick`` into a temporary folder: one back-to-back pair per
layout (TP=2 x 2 replicas, PP=2 x 2 replicas under ckptless_hpc, then in plain torch), then a
killed rank under tp, pp and ddp. Benchmarks are not timed tests: no duration or ratio is
asserted, only that the JSON holds each figure, that every faulted run ended bitwise equal to
its fault-free run (the oracle), and that the plain baseline trains what ckptless_hpc trains
(the last step's loss over the global batch agrees).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import parallel_bench

REPO = Path(__file__).resolve().parents[2]
VERDICTS = ("yes", "NO", "unresolved at this load")
LAYOUT_KEYS = (
    "ckptless_step_s", "plain_step_s", "overhead_pct", "pair_overheads_pct", "verdict", "ckptless_in_step_s", "plain_in_step_s",
    "cpu_overhead_pct", "pair_cpu_overheads_pct", "final_loss_abs_diff_max", "pairs",
)  # fmt: skip
PAIR_KEYS = ("ckptless_step_s", "plain_step_s", "ratio", "cpu_ratio", "ckptless_cpu_s_per_step", "plain_cpu_s_per_step", "ckptless_final_loss", "plain_final_loss")
RECOVERY_KEYS = ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s", "bytes_transferred", "oracle", "final_state_sha256", "fault_free_sha256", "step_s")


def test_headline_of_a_missing_section_is_all_none():
    h = parallel_bench.headline(None)
    assert h and all(v is None for v in h.values()), h
    assert parallel_bench.headline({"status": "error: x"}) == h


def test_the_runs_differ_from_their_fault_free_run_by_the_fault_alone():
    plan = parallel_bench.PLANS["quick"]
    for mode in parallel_bench.RECOVERY_MODES:
        clean, faulted = parallel_bench.overrides(plan, mode), parallel_bench.overrides(plan, mode, fault=True)
        assert faulted[: len(clean)] == clean and faulted[len(clean) :] == ["fault=kill_worker", "fault.rank=3", f"fault.step={plan.fault_step}"], faulted
        assert "cluster.workers_per_node=2" in clean and f"train.steps={plan.steps}" in clean, clean
    assert plan.fault_step < plan.steps and plan.skip_steps + 2 < plan.steps, plan
    assert "train.grad_accum=4" in parallel_bench.overrides(plan, "pp") and "cluster.params_first=false" in parallel_bench.overrides(plan, "ddp_whole")


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_quick_section_writes_every_field(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench.parallel_bench", "--quick", "--results", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=880)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads((tmp_path / "quick-parallel.json").read_text())
    for key in ("mode", "command", "date", "headline", "elapsed_s"):
        assert res[key], key
    m = res["machine"]
    assert m["core_commit"] and len(m["loadavg_at_start"]) == 3 and len(m["loadavg_at_end"]) == 3, m
    sec = res["parallel"]
    for mode in ("tp", "pp"):
        s = sec[mode]
        assert set(LAYOUT_KEYS) <= set(s), (mode, sorted(s))
        assert s["verdict"] in VERDICTS and len(s["pairs"]) == sec["pairs"] == len(s["pair_overheads_pct"]), s
        assert s["median_verdict"] == "too few pairs" and s["median_interval_pct"]["n"] == sec["pairs"], s  # one pair: --pairs 5 or more gives one
        for pair in s["pairs"]:
            assert set(PAIR_KEYS) <= set(pair), sorted(pair)
            assert pair["ckptless_step_s"] > 0 and pair["plain_step_s"] > 0, pair
        # the same training: ckptless_hpc's summary and the plain run agree on the last step's global loss
        assert s["final_loss_abs_diff_max"] is not None and s["final_loss_abs_diff_max"] < 1e-4, s
    for mode in parallel_bench.RECOVERY_MODES:
        r = sec["recovery"][mode]
        assert set(RECOVERY_KEYS) <= set(r), (mode, sorted(r))
        assert r["oracle"] and r["final_state_sha256"] == r["fault_free_sha256"], (mode, r)  # bitwise equal to its fault-free run
        assert r["bytes_transferred"] > 0 and r["downtime_s"] > 0 and r["failed_ranks"] == [3], (mode, r)
    assert sec["oracle"] is True
    # every headline figure is there and finite
    assert set(res["headline"]) == set(parallel_bench.headline(None)), res["headline"]
    assert all(v is not None and math.isfinite(v) for v in res["headline"].values()), res["headline"]
    assert "TP=2 x 2 replicas" in p.stdout and "bitwise" in p.stdout, p.stdout


def test_the_runner_carries_the_section_and_the_quick_smoke_leaves_it_out(tmp_path):
    """``python -m bench`` runs the section (and ``--only parallel``); the quick smoke skips it
    (its 11 jobs take minutes: the test below runs its quick variant); ``--add-to-latest`` adds the
    section and its headline keys to latest.json, changing nothing else; the table has its rows."""
    from bench import report, run
    from bench.plan import PLANS

    assert "parallel" in run.SECTIONS and "parallel" in run.INDEPENDENT
    skipped = run.Bench(PLANS["quick"], tmp_path).parallel(in_run=True)
    assert skipped["status"].startswith("skipped: not in the quick run"), skipped
    assert report.parallel_rows(skipped) == [["TP / PP vs plain torch (issue 31)", skipped["status"], "<=2%", "n/a"]]
    measured = json.loads((REPO / "bench" / "results" / "only-parallel.json").read_text())
    latest = tmp_path / "latest.json"
    latest.write_text(json.dumps({"b3": {"overhead_pct": 1.0}, "b3_overhead_pct": 1.0}))
    run._add_to_latest(measured, ["parallel"], latest)
    got = json.loads(latest.read_text())
    assert got["b3"] == {"overhead_pct": 1.0} and got["b3_overhead_pct"] == 1.0
    assert got["parallel"]["tp"]["overhead_pct"] == measured["parallel"]["tp"]["overhead_pct"] and got["parallel"]["measured"]["command"] == measured["command"]
    assert {k: got[k] for k in parallel_bench.headline(None)} == parallel_bench.headline(measured["parallel"])
    rows = report.parallel_rows(got["parallel"])
    assert [r[0].split(" vs ")[0] for r in rows] == ["TP=2 x 2 replicas", "PP=2 (gpipe, 4 micro-batches) x 2 replicas", "TP / PP lost rank"], rows
    assert rows[0][3] == got["parallel"]["tp"]["verdict"] and "oracle held" in rows[2][1]


def test_the_plain_worker_clips_as_torch_does_and_the_jobs_clip_too():
    """bench/plain_parallel_worker.py clip (torchtitan's clip_grad_norm_ for plain tensors, one
    process: no pipeline group) against torch.nn.utils.clip_grad_norm_, and both sides of the
    section clip at the same max_norm (the jobs' train.clip_grad_norm)."""
    import torch

    from bench.plain_parallel_worker import clip

    def grads(seed: int):
        torch.manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(n)) for n in (7, 3, 11)]
        for p in ps:
            p.grad = torch.randn_like(p) * 3
        return ps

    mine, theirs = grads(0), grads(0)
    total = clip(mine, 1.0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.allclose(total, want) and float(total) > 1.0, (total, want)  # the clip bites
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(mine, theirs))
    plan = parallel_bench.PLANS["quick"]
    assert f"train.clip_grad_norm={parallel_bench.CLIP}" in parallel_bench.overrides(plan, "pp") and parallel_bench.CLIP == 1.0


def test_the_gate_counts_only_the_steps_a_side_ran_whole(tmp_path):
    """bench/gate.py, pure logic: a block's clean intervals leave out its first step (which holds the wait at the gate)."""
    from bench import gate

    g = tmp_path / "side"
    gate.allow(g, 2)
    assert gate.allowed(g) == 2 and gate.parked_at(g) == []
    # one rank's step ends: 2 warm-up steps, a wait of 10 s, then a block of 3 steps of 1 s
    (tmp_path / "side.times.11").write_text("1 100.0\n2 101.0\n3 112.0\n4 113.0\n5 114.0\n")
    (tmp_path / "side.times.12").write_text("1 100.5\n2 101.5\n3 112.5\n4 113.5\n5 114.5\n")
    assert gate.block_intervals(g, 2, 5) == [1.0, 1.0, 1.0, 1.0]
    (tmp_path / "side.parked.11").write_text("5")
    assert gate.parked_at(g) == [5]
    with pytest.raises(TimeoutError):
        gate.wait_parked(g, 2, 5, timeout_s=0.05)
    (tmp_path / "side.parked.12").write_text("5")
    assert gate.wait_parked(g, 2, 5, timeout_s=1) < 1
    assert gate.block_pairs([([1.1, 1.1, 1.0], [1.0, 1.0, 1.0]), ([], [1.0])]) == [1.1]


def test_interleaved_turns_give_each_side_the_steps_of_its_turn_and_train_the_same(tmp_path):
    """``--interleave``: a ckptless_hpc job and a plain run alive at once, taking turns; each turn of 3 steps gives each of the
    4 ranks 2 clean intervals, and the two sides still train the same thing (their last global loss agrees)."""
    argv = [sys.executable, "-m", "bench.parallel_bench", "--quick", "--interleave", "2", "--block", "3", "--results", str(tmp_path)]
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads((tmp_path / "quick-parallel-quick-interleaved.json").read_text())
    assert res["command"].endswith("--interleave 2 --block 3 --results " + str(tmp_path)), res["command"]
    for mode in ("tp", "pp"):
        s = res["interleaved"][mode]
        assert s["blocks"] == 2 and s["intervals_per_block"] == [8, 8], s
        assert len(s["block_overheads_pct"]) == 2 and all(math.isfinite(x) for x in s["block_overheads_pct"]), s
        assert s["ckptless_step_s"] > 0 and s["plain_step_s"] > 0 and s["median_verdict"] == "too few pairs", s
        assert abs(s["ckptless_final_loss"] - s["plain_final_loss"]) < 1e-4, s
    assert "interleaved" in p.stdout and "TP=2 x 2 replicas" in p.stdout, p.stdout


def test_repeated_interleaved_runs_pool_their_turns():
    """``--repeat``, pure logic: the runs' turns pooled into one median and interval, each run's median kept beside it."""
    from bench.common import median_interval

    def run(turns, step_s):
        side = {"blocks": len(turns), "block_steps": 5, "ckptless_step_s": step_s * 1.01, "plain_step_s": step_s, "overhead_pct": sorted(turns)[len(turns) // 2],
                "pooled_overhead_pct": 1.0, "block_overheads_pct": list(turns), "median_interval_pct": median_interval(turns), "median_verdict": "x",
                "intervals_per_block": [16] * len(turns), "ckptless_cores_while_parked": 0.1, "plain_cores_while_parked": 0.2, "ckptless_final_loss": 0.5,
                "plain_final_loss": 0.5, "ckptless_run": "r", "elapsed_s": 10.0}  # fmt: skip
        return {"plan": "tokens", "target_pct": 2.0, "tp": side, "elapsed_s": 10.0}

    a, b = run([-3.0, -1.0, 0.0, 1.0, 2.0], 0.5), run([3.0, 4.0, 5.0], 0.7)
    p = parallel_bench.pool_runs([a, b])
    tp = p["tp"]
    assert tp["runs"] == 2 and "pp" not in p and tp["blocks"] == 8 and p["elapsed_s"] == 20.0, p
    assert tp["overhead_pct"] == 1.5 and tp["runs_overhead_pct"] == [0.0, 4.0], tp  # the median of all eight turns, not of the two runs' medians (2.0)
    ci = tp["median_interval_pct"]
    assert ci["n"] == 8 and ci["low"] == -1.0 and ci["high"] == 4.0, ci
    assert tp["median_verdict"] == "unresolved" and tp["ckptless_step_s"] == pytest.approx(0.606) and tp["plain_step_s"] == pytest.approx(0.6), tp
    assert "TP=2 x 2 replicas, 2 runs" in parallel_bench.table_interleaved({**p, "pp_micro_batches": 4, "task": "x.T", "sizes": {}, "params": 1e6})


def test_interleaved_results_of_earlier_runs_pool_across_files(tmp_path):
    """``--pool``: the runs in earlier files (one run; several, kept per run) pooled; files of different measurements refused."""
    from bench.common import BenchError, median_interval

    def run(turns, block=5):
        side = {"blocks": len(turns), "block_steps": block, "ckptless_step_s": 0.5, "plain_step_s": 0.5, "overhead_pct": sorted(turns)[len(turns) // 2],
                "pooled_overhead_pct": 0.0, "block_overheads_pct": list(turns), "median_interval_pct": median_interval(turns), "median_verdict": "x",
                "intervals_per_block": [16] * len(turns), "ckptless_cores_while_parked": 0.1, "plain_cores_while_parked": 0.1, "elapsed_s": 1.0}  # fmt: skip
        return {"plan": "tokens", "sizes": {"seq_len": 64, "batch_size": 32}, "target_pct": 2.0, "tp": side, "elapsed_s": 1.0}

    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps({"machine": {"core_commit": "a"}, "interleaved": run([9.0, 10.0, 11.0])}))
    runs = [run([0.0, 1.0, 2.0]), run([3.0, 4.0, 5.0])]
    two.write_text(json.dumps({"machine": {"core_commit": "b"}, "interleaved": parallel_bench.pool_runs(runs), "interleaved_runs": runs}))
    p = parallel_bench.pool_files([one, two])
    assert p["tp"]["runs"] == 3 and p["tp"]["runs_overhead_pct"] == [10.0, 1.0, 4.0] and p["tp"]["overhead_pct"] == 4.0, p["tp"]
    assert p["sources"] == ["one.json (core a)", "two.json (core b)"] and "source" not in p, p  # each file once
    one.write_text(json.dumps({"machine": {}, "interleaved": run([1.0, 2.0, 3.0], block=3)}))
    with pytest.raises(BenchError, match="different things"):
        parallel_bench.pool_files([one, two])
