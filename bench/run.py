"""``python -m bench [--quick] [--results DIR]``: every benchmark of issue 5, side by side in one run.

B1 recovery downtime (kill, hang) at two model sizes vs a real checkpoint-restart baseline;
B2 the same kill under TorchFT (optional package); B3 steady-state step time vs plain DDP;
B4 peer state transfer vs raw loopback TCP; B5 downtime at 2, 4, 8 workers; B6 goodput with
failures every ``interval`` seconds, locally for both systems and extrapolated to 1k-100k GPUs
by ``ckptless_hpc.tools.sim``; B7 the coordinator under simulated ranks; B8 sharded state;
B9 elastic (the fixed-order reduction's overhead, a shrunk job's step, a shrink's downtime vs a
spare's promotion); parallel: tensor and pipeline parallel against plain torch, and a lost TP/PP
rank's downtime and bytes (bench/parallel_bench.py; not in ``--quick``). Prints a table; writes
``DIR/latest.json`` and ``DIR/latest.png``.
Run directories of every job go to ``DIR/tmp`` (not committed).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

if __package__ in (None, ""):  # python bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

from ckptless_hpc.tools import sim  # noqa: E402

from . import b5 as b5lib, b7 as b7lib, b8 as b8lib, b9 as b9lib, ckpt_restart, copy_cost as copy_cost_lib, figures, fsdp_warmup as fsdp_warmup_lib  # noqa: E402
from . import moves_bench as moves_lib, parallel_bench as parallel_lib, report, slurm_path, torchft_bench, transfer  # noqa: E402
from .common import REPO, SIZES, BenchError, JobRun, cpu_per_step, finite, lm_params, machine_info, median, run_ckptless, spread, task_overrides, torchft_version, verdict  # noqa: E402
from .plan import PLANS, Plan  # noqa: E402

DEFAULT_RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "benchmarks.md"

# Recovery timings run without the background refill of the spare pool: on one 2-core machine
# the refill's process start (import torch, build the model) competes with the first step after
# the recovery, which a cluster runs on another node (docs/benchmarks.md, "Problems found").
NO_REFILL = ["cluster.refill_spares=false"]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


_f = finite


class Bench:
    def __init__(self, plan: Plan, tmp: Path) -> None:
        self.plan = plan
        self.tmp = tmp
        self.runs: Dict[tuple, List[JobRun]] = {}
        self.sims: Dict[tuple, List[Dict[str, Any]]] = {}
        self.n = 0

    # ---------------------------------------------------------------- jobs, cached by config
    def job(self, label: str, overrides: List[str], reps: int = 1, sample_cpu: bool = False, env: Optional[Dict[str, str]] = None) -> List[JobRun]:
        """``reps`` runs of a ckptless_hpc job; an identical config (and ``env``) asked twice is run once."""
        key = tuple(sorted(overrides)) + tuple(sorted((env or {}).items()))
        have = self.runs.setdefault(key, [])
        while len(have) < reps:
            self.n += 1
            run_dir = self.tmp / f"{self.n:02d}-{label}"
            shutil.rmtree(run_dir, ignore_errors=True)
            t0 = time.monotonic()
            have.append(run_ckptless(run_dir, overrides, sample_cpu=sample_cpu, env=env))
            log(f"  {label}: {time.monotonic() - t0:.0f}s ({run_dir.name})")
        return have[:reps]

    def sim_point(self, label: str, ranks: int, steady_s: float, control: str, rep: int = 0) -> Dict[str, Any]:
        """Repetition ``rep`` of B7's coordinator under ``ranks`` simulated ranks (bench/b7.py
        ``run_point``); a point asked again with the same window (B5's largest world and B7's in
        the quick plan) is run once."""
        have = self.sims.setdefault((ranks, self.plan.b7_wpn, steady_s, control), [])
        while len(have) <= rep:
            have.append(b7lib.run_point(ranks, self.plan.b7_wpn, steady_s, self.rundir(f"{label}-{ranks}-{control}"), control=control))
        return have[rep]

    def rundir(self, label: str) -> Path:
        self.n += 1
        d = self.tmp / f"{self.n:02d}-{label}"
        shutil.rmtree(d, ignore_errors=True)
        return d

    # ---------------------------------------------------------------- B3: steady state
    def b3(self) -> Dict[str, Any]:
        p = self.plan
        log(f"B3 steady state: {p.b3_size} model, 2 workers, {p.b3_steps} steps, {p.b3_reps} back-to-back pairs")
        ft_missing = torchft_bench.available()
        ck_iv, ck_in, ddp_iv, ddp_in, ft_iv, ratios = [], [], [], [], [], []
        cpu = {"ckptless_ranks": [], "ckptless_all": [], "ddp_ranks": []}
        for rep in range(p.b3_reps):
            j = self.job("b3-ckptless", task_overrides(p.b3_size) + [f"train.steps={p.b3_steps}"], rep + 1, sample_cpu=True)[rep]
            t0 = time.monotonic()
            b = ckpt_restart.run_baseline(self.rundir("b3-ddp"), p.b3_size, 2, p.b3_steps, 0, [], sample_cpu=True)
            log(f"  b3-ddp: {time.monotonic() - t0:.0f}s")
            ck_iv += j.step_intervals()
            ck_in += j.step_times()
            ddp_iv += b.step_intervals()
            ddp_in += [e["step_s"] for e in b.steps_log if e["step"] > 5]
            ratios.append(median(j.step_intervals()) / median(b.step_intervals()))
            ck_t = [e["time"] for e in j.of("step")]
            cpu["ckptless_ranks"].append(cpu_per_step(j.cpu_samples, ck_t, _active_rank))
            cpu["ckptless_all"].append(cpu_per_step(j.cpu_samples, ck_t, lambda cmd: True))
            cpu["ddp_ranks"].append(cpu_per_step(b.cpu_samples, [e["t"] for e in b.steps_log], lambda cmd: "bench.plain_worker" in cmd))
            if ft_missing is None and p.b3_torchft and rep < 2:
                t0 = time.monotonic()
                f = torchft_bench.run_torchft(self.rundir("b3-torchft"), p.b3_size, 2, p.b3_steps, None, -1)
                log(f"  b3-torchft: {time.monotonic() - t0:.0f}s")
                ft_iv += f.step_intervals()
        ck, ddp = median(ck_iv), median(ddp_iv)
        cpu_med = {k: median(v) for k, v in cpu.items()}
        out = {
            "size": p.b3_size,
            "params": lm_params(p.b3_size),
            "world": 2,
            "steps": p.b3_steps,
            "reps": p.b3_reps,
            "ckptless_step_s": ck,
            "ddp_step_s": ddp,
            # the median over back-to-back pairs of (ckptless / DDP): robust to load drifting between pairs
            "overhead_pct": 100.0 * (median(ratios) - 1.0),
            "pair_ratios": ratios,
            # <= 2 % only when every pair says so ("unresolved at this load" when they disagree)
            "verdict": verdict([100.0 * (r - 1.0) for r in ratios], 2.0),
            "pooled_overhead_pct": 100.0 * (ck / ddp - 1.0),
            "ckptless_in_step_s": median(ck_in),
            "ddp_in_step_s": median(ddp_in),
            "cpu_s_per_step": cpu_med,
            "cpu_overhead_ranks_pct": 100.0 * (cpu_med["ckptless_ranks"] / cpu_med["ddp_ranks"] - 1.0),
            "cpu_overhead_all_pct": 100.0 * (cpu_med["ckptless_all"] / cpu_med["ddp_ranks"] - 1.0),
            "torchft_step_s": median(ft_iv) if ft_iv else None,
            "torchft_overhead_pct": 100.0 * (median(ft_iv) / ddp - 1.0) if ft_iv else None,
        }
        log(
            f"  ckptless {1e3 * ck:.1f} ms/step, DDP {1e3 * ddp:.1f} ms/step: overhead {out['overhead_pct']:+.1f}% (pairs {[round(r, 3) for r in ratios]}); "
            f"CPU per step: ranks {out['cpu_overhead_ranks_pct']:+.1f}%, with coordinator and spare {out['cpu_overhead_all_pct']:+.1f}% (nan: run too short to sample)"
        )
        return out

    # ---------------------------------------------------------------- B4: transfer
    def b4(self) -> Dict[str, Any]:
        p = self.plan
        log(f"B4 transfer: {p.b4_bytes / 1e6:.0f} MB, {p.b4_reps} repetitions")
        out = transfer.measure(p.b4_bytes, p.b4_reps)
        log(f"  state transfer {out['state_transfer_gbps']:.2f} GB/s vs raw TCP {out['raw_tcp_gbps']:.2f} GB/s ({100 * out['fraction_of_loopback']:.0f}%)")
        out["sources"] = transfer.measure_sources(p.b4_bytes, p.b4_reps)  # several sources at once (issue 14)
        log("  from several sources at once (loopback): " + ", ".join(f"{k}: {v:.2f} GB/s" for k, v in out["sources"]["gbps"].items()))
        return out

    # ---------------------------------------------------------------- B1: recovery vs restart
    def b1(self, b4: Dict[str, Any]) -> Dict[str, Any]:
        points = []
        for pt in self.plan.b1:
            log(f"B1 {pt.size}: ckptless kill + hang (fault at step {pt.fault_step}), checkpoint-restart (K={pt.ckpt_every}, kill at step {pt.base_fault_step})")
            base = task_overrides(pt.size) + NO_REFILL + [f"train.steps={pt.steps}"]
            kills = self.job(f"b1-{pt.size}-kill", base + ["fault=kill_worker", "fault.rank=1", f"fault.step={pt.fault_step}"], pt.reps)
            hangs = self.job(f"b1-{pt.size}-hang", base + ["fault=hang", "fault.rank=1", f"fault.step={pt.fault_step}"], pt.reps)
            fault_free = self.job(f"b1-{pt.size}-fault-free", base)[0].summary["final_state_sha256"]  # the oracle
            restarts = []
            for _ in range(pt.reps):
                t0 = time.monotonic()
                d = self.rundir(f"b1-{pt.size}-restart")
                r = ckpt_restart.run_baseline(d, pt.size, 2, pt.base_steps, pt.ckpt_every, [{"rank": 1, "step": pt.base_fault_step}])
                (d / "ckpt.pt").unlink(missing_ok=True)
                log(f"  b1-{pt.size}-restart: {time.monotonic() - t0:.0f}s")
                restarts.append(r)
            points.append(self._b1_point(pt, kills, hangs, restarts, b4, fault_free))
        return {"points": points}

    def _b1_point(self, pt, kills: List[JobRun], hangs: List[JobRun], restarts: list, b4: Dict[str, Any], fault_free: str) -> Dict[str, Any]:
        def phases(runs: List[JobRun]) -> Dict[str, float]:
            recs = [r.summary["recoveries"][0] for r in runs]
            keys = ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s", "bytes_transferred")
            return {k: median(rec[k] for rec in recs) for k in keys}

        fails = [r.failures[0] for r in restarts]
        cr = {k: median(getattr(f, k) for f in fails) for k in ("downtime_s", "detect_s", "stop_s", "restart_s", "load_s", "first_step_s")}
        cr["lost_steps"] = median(f.lost_steps for f in fails)
        cr["save_s"] = median(s for r in restarts for s in r.save_s)
        step_s = median(iv for r in kills for iv in r.step_intervals(skip=1))
        kill, hang = phases(kills), phases(hangs)
        bw = b4["state_transfer_gbps"] * 1e9
        bound = 1.0 + kill["bytes_transferred"] / bw
        recovery_s = kill["detect_s"] + kill["reconfigure_s"] + kill["transfer_s"]
        out = {
            "size": pt.size,
            "params": lm_params(pt.size),
            "state_bytes": kill["bytes_transferred"],
            "step_s": step_s,
            "reps": pt.reps,
            "kill": kill,
            "hang": hang,
            "ckpt_restart": cr,
            "ckpt_every": pt.ckpt_every,
            "lost_work_s": cr["lost_steps"] * step_s,
            "ratio_kill": cr["downtime_s"] / kill["downtime_s"],
            # time lost beyond the step that had to be computed anyway (downtime - one step)
            "kill_recovery_s": recovery_s,
            # (never below the recovery phases themselves, when the first step beat the median)
            "ckptless_lost_s": max(kill["downtime_s"] - step_s, recovery_s),
            "ckpt_restart_lost_s": cr["downtime_s"] - step_s,
            "target_bound_s": bound,
            "kill_net_of_step_s": kill["downtime_s"] - step_s,
            # every repetition, and median/min/max of each downtime (the table's "median (min-max)")
            "spread": {
                "kill_downtime_s": spread(r.summary["recoveries"][0]["downtime_s"] for r in kills),
                "hang_downtime_s": spread(r.summary["recoveries"][0]["downtime_s"] for r in hangs),
                "ckpt_restart_downtime_s": spread(f.downtime_s for f in fails),
            },
            # the oracle: every faulted run ends bitwise equal to the fault-free run of the same config
            "fault_free_final_sha": fault_free,
            "oracle": all(r.summary["final_state_sha256"] == fault_free for r in kills + hangs),
        }
        out["ratio_lost_time"] = out["ckpt_restart_lost_s"] / out["ckptless_lost_s"]
        log(
            f"  {pt.size}: ckptless kill {kill['downtime_s']:.2f}s, hang {hang['downtime_s']:.2f}s; checkpoint-restart {cr['downtime_s']:.2f}s "
            f"(restart {cr['restart_s']:.2f}s, {cr['lost_steps']:.0f} steps redone): ratio {out['ratio_kill']:.1f}x"
        )
        return out

    # ---------------------------------------------------------------- B1 on real Slurm
    def b1_slurm(self) -> Dict[str, Any]:
        """A crashed node and a killed step on the mini-cluster vs the local killed worker (bench/slurm_path.py)."""
        p = self.plan
        if p.b1_slurm_reps <= 0:
            return {"status": f"skipped: not in the {p.name} run (python -m bench --only b1_slurm)"}
        env, why = slurm_path.ensure_cluster()
        if env is None:
            log(f"B1 Slurm: {why}")
            return {"status": why}
        log(f"B1 Slurm: {p.b1_slurm_size} model, {p.b1_slurm_steps} steps, rank 1's node crashed / its step cancelled after step {p.b1_slurm_fault_step}, {p.b1_slurm_reps} each")
        base = task_overrides(p.b1_slurm_size) + NO_REFILL + [f"train.steps={p.b1_slurm_steps}"]
        local = self.job("b1-slurm-local-kill", base + ["fault=kill_worker", "fault.rank=1", f"fault.step={p.b1_slurm_fault_step}"], p.b1_slurm_reps)
        fault_free = self.job("b1-slurm-local-fault-free", base)[0].summary["final_state_sha256"]
        runs = slurm_path.SlurmRuns(env, p.b1_slurm_size, p.b1_slurm_steps, p.b1_slurm_fault_step)
        crash, step = [], []
        for _ in range(p.b1_slurm_reps):  # alternated, so that load drifts hit both
            for kind, into in (("crash", crash), ("step", step)):
                t0 = time.monotonic()
                into.append(runs.faulted(kind, self.rundir(f"b1-slurm-{kind}")))
                log(f"  b1-slurm-{kind}: {time.monotonic() - t0:.0f}s: downtime {into[-1]['downtime_s']:.3f}s, scancel {into[-1]['scancel_s']}s")
        out = dict(slurm_path.summarize(crash, step, local, fault_free), status="ok", size=p.b1_slurm_size, steps=p.b1_slurm_steps, fault_step=p.b1_slurm_fault_step)
        log(
            f"  crashed node {out['crash']['downtime_s']:.3f}s, killed step {out['step']['downtime_s']:.3f}s vs local killed worker "
            f"{out['local_kill']['downtime_s']:.3f}s (+{out['crash_over_local_s']:.3f}s, +{out['step_over_local_s']:.3f}s); "
            f"scancel of the dead step {out['crash']['scancel_s']:.2f}s, off the path; oracle {out['crash']['oracle'] and out['step']['oracle']}"
        )
        return out

    # ---------------------------------------------------------------- B5: a recovery's work as the world grows
    def b5(self) -> Dict[str, Any]:
        """B5 (bench/b5.py): the coordinator's and a survivor's work per recovery at growing world
        sizes, simulated ranks (B7's harness), with relays and without."""
        p = self.plan
        log(f"B5 a recovery's work vs the world: simulated ranks {list(p.b5_ranks)} ({p.b7_wpn} per node), cluster.control {list(p.b5_controls)}, "
            f"{p.b5_sim_reps} run(s) each, steady window {p.b5_steady_s:.0f}s")
        out = b5lib.run(self, log)
        log("  " + b5lib.one_line(out))
        return out

    # the real-process recovery at 2, 4, 8 workers (the earlier B5): what gloo_lazy compares
    def _b5_summary(self, runs: Dict[int, List[JobRun]]) -> Dict[str, Any]:
        p = self.plan
        rows = []
        for n in p.b5_nodes:
            recs = [r.summary["recoveries"][0] for r in runs[n]]
            step = median(iv for r in runs[n] for iv in r.step_intervals(skip=1))
            row = {k: median(rec[k] for rec in recs) for k in ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s")}
            row.update(workers=n, step_s=step, recovery_excl_resume_s=row["detect_s"] + row["reconfigure_s"] + row["transfer_s"])
            row["downtime_steps"] = row["downtime_s"] / step  # in units of this world's own step time
            rows.append(row)
        lo, hi = rows[0], rows[-1]
        out = {
            "size": p.b5_size,
            "rows": rows,
            "growth_pct": 100.0 * (hi["downtime_s"] / lo["downtime_s"] - 1.0),
            "growth_excl_resume_pct": 100.0 * (hi["recovery_excl_resume_s"] / lo["recovery_excl_resume_s"] - 1.0),
            "step_growth_pct": 100.0 * (hi["step_s"] / lo["step_s"] - 1.0),
            "growth_in_steps_pct": 100.0 * (hi["downtime_steps"] / lo["downtime_steps"] - 1.0),
            "resume_growth_pct": 100.0 * (hi["resume_s"] / lo["resume_s"] - 1.0),  # the first step: where a lazily connected group pays
            "from_to": [lo["workers"], hi["workers"]],
        }
        return out

    # ---------------------------------------------------------------- gloo's lazy connection setup
    def gloo_lazy(self) -> Dict[str, Any]:
        """B5 and B3 with cluster.gloo_lazy_connect=true (TORCH_GLOO_LAZY_INIT=1: pairs connect on
        first use; the formation ends with the store barrier) and =false (every pair at
        formation), interleaved run by run so that load drifts hit both."""
        p = self.plan
        variants = {"lazy": ["cluster.gloo_lazy_connect=true"], "eager": ["cluster.gloo_lazy_connect=false"]}
        log(f"gloo lazy vs eager connection setup: B5 ({p.b5_size} model, workers {p.b5_nodes}, {p.b5_reps} each) and B3 ({p.b3_size}, {p.b3_steps} steps, {p.b3_reps} pairs)")
        b5: Dict[str, Dict[int, List[JobRun]]] = {v: {n: [] for n in p.b5_nodes} for v in variants}
        failed: Dict[str, List[Dict[str, str]]] = {v: [] for v in variants}  # a recovery that did not complete is a finding, not a crash of the bench
        for _rep in range(p.b5_reps):
            for n in p.b5_nodes:
                for v, env in variants.items():
                    d = self.rundir(f"gloo-{v}-b5-n{n}")
                    t0 = time.monotonic()
                    try:
                        b5[v][n].append(run_ckptless(d, self._b5_overrides(n) + env))
                    except BenchError as e:
                        failed[v].append({"run_dir": str(d), "workers": str(n), "error": str(e).splitlines()[0][:300]})
                    log(f"  gloo-{v}-b5-n{n}: {time.monotonic() - t0:.0f}s ({d.name}){' FAILED' if failed[v] and failed[v][-1]['run_dir'] == str(d) else ''}")
        # B3's three views per back-to-back pair: step interval, in-step time, CPU seconds per step
        # of the two ranks (CPU time does not stretch when other users take the cores)
        views: Dict[str, Dict[str, List[float]]] = {v: {"interval": [], "in_step": [], "cpu": []} for v in variants}
        for rep in range(p.b3_reps):
            for v, env in variants.items():
                j = self.job(f"gloo-{v}-b3", task_overrides(p.b3_size) + [f"train.steps={p.b3_steps}"] + env, rep + 1, sample_cpu=True)[rep]
                views[v]["interval"].append(median(j.step_intervals()))
                views[v]["in_step"].append(median(j.step_times()))
                views[v]["cpu"].append(cpu_per_step(j.cpu_samples, [e["time"] for e in j.of("step")], _active_rank))
        out: Dict[str, Any] = {
            v: {"overrides": env, "b5": self._b5_summary(b5[v]), "b5_failed": failed[v], "b3": {k: median(x) for k, x in views[v].items()}, "b3_per_rep": views[v]}
            for v, env in variants.items()
        }
        for k in ("interval", "in_step", "cpu"):
            ratios = [a / b for a, b in zip(views["lazy"][k], views["eager"][k])]
            out[f"b3_lazy_over_eager_{k}_pct"] = 100.0 * (median(ratios) - 1.0)
            out[f"b3_pair_ratios_{k}"] = ratios
        for v in variants:
            b = out[v]["b5"]
            log(f"  {v}: B5 growth {b['growth_pct']:+.0f}% (excl. first step {b['growth_excl_resume_pct']:+.0f}%, first step {b['resume_growth_pct']:+.0f}%), "
                f"reconfigure {[round(r['reconfigure_s'], 3) for r in b['rows']]}; {len(failed[v])} B5 run(s) failed; "
                f"B3 step {1e3 * out[v]['b3']['interval']:.2f} ms, CPU {1e3 * out[v]['b3']['cpu']:.2f} ms/step")
        log("  B3 lazy vs eager: " + ", ".join(f"{k} {out[f'b3_lazy_over_eager_{k}_pct']:+.1f}%" for k in ("interval", "in_step", "cpu")))
        return out

    def _b5_overrides(self, n: int) -> List[str]:
        p = self.plan
        nodes = [] if n == 2 else [f"cluster.nodes={n}"]  # 2 is the default: shares runs with B1/B2
        return task_overrides(p.b5_size) + NO_REFILL + nodes + [f"train.steps={p.b5_steps}", "fault=kill_worker", "fault.rank=1", f"fault.step={p.b5_fault_step}"]

    # ---------------------------------------------------------------- B2: TorchFT
    def b2(self, b3: Dict[str, Any]) -> Dict[str, Any]:
        p = self.plan
        missing = torchft_bench.available()
        if missing is not None and p.b2_required:  # a full run without B2 is a failed run, not a skipped section
            raise BenchError(f"B2 needs torchft ({missing}). HINT: bash bench/setup.sh (pip install --no-deps torchft-nightly and its OpenTelemetry packages)")
        if missing is not None:
            log(f"B2 skipped: torchft not installed ({missing})")
            return {"status": "skipped: torchft not installed", "reason": missing}
        log(f"B2 TorchFT: {p.b2_size} model, 2 replicas, kill replica 1 at step {p.b2_fault_step}")
        ours = self.job("b2-ckptless-kill", task_overrides(p.b2_size) + NO_REFILL + [f"train.steps={p.b2_steps}", "fault=kill_worker", "fault.rank=1", f"fault.step={p.b2_fault_step}"], p.b2_reps)
        recs, pre_fault = [], []
        for _ in range(p.b2_reps):
            t0 = time.monotonic()
            r = torchft_bench.run_torchft(self.rundir("b2-torchft-kill"), p.b2_size, 2, p.b2_steps, 1, p.b2_fault_step)
            log(f"  b2-torchft-kill: {time.monotonic() - t0:.0f}s")
            recs.append(r.recovery)
            pre_fault += r.step_intervals()
        ft = {k: median(r[k] for r in recs) for k in recs[0] if k != "t_fail"}
        ck = median(r.summary["recoveries"][0]["downtime_s"] for r in ours)
        over = b3.get("torchft_overhead_pct")
        if over is None and p.b2_size == b3["size"] and pre_fault:
            over = 100.0 * (median(pre_fault) / b3["ddp_step_s"] - 1.0)  # quick mode: no separate TorchFT run in B3
        out = {
            "status": "ok",
            "torchft_version": torchft_version(),
            "size": p.b2_size,
            "torchft": ft,
            "ckptless_downtime_s": ck,
            "ratio": ft["downtime_s"] / ck,
            "torchft_overhead_pct": over,
            "ckptless_overhead_pct": b3.get("overhead_pct") if p.b2_size == b3["size"] else None,
        }
        log(f"  TorchFT {ft['downtime_s']:.2f}s vs ckptless {ck:.3f}s: {out['ratio']:.0f}x")
        return out

    # ---------------------------------------------------------------- B6: goodput
    def b6(self, b3: Dict[str, Any]) -> Dict[str, Any]:
        p = self.plan
        n, interval = p.b6_failures, p.b6_interval_s
        step_ck = b3["ckptless_step_s"] if p.b6_size == p.b3_size else None
        step_ddp = b3["ddp_step_s"] if p.b6_size == p.b3_size else None
        if step_ck is None:
            raise BenchError(f"B6 needs the step time of {p.b6_size}: make b6_size equal to b3_size")
        steps = int(round(n * interval / step_ck))
        fault_steps = [int(round((i + 0.5) * interval / step_ck)) for i in range(n)]
        ranks = [1 if i % 2 == 0 else 0 for i in range(n)]
        log(f"B6 goodput: {p.b6_size} model, {steps} steps, a kill every {interval:.0f}s (steps {fault_steps}), {n} hot spares")
        sched = ",".join(f"{{kind:kill_worker,rank:{r},step:{s}}}" for r, s in zip(ranks[1:], fault_steps[1:]))
        ov = task_overrides(p.b6_size) + [
            f"train.steps={steps}", "fault=kill_worker", f"fault.rank={ranks[0]}", f"fault.step={fault_steps[0]}",
            f"fault.schedule=[{sched}]", f"cluster.spare_nodes={n}", "cluster.refill_spares=false",
        ]
        j = self.job("b6-ckptless", ov, 1)[0]
        ck_steps = [{"step": e["step"], "t": e["time"]} for e in j.of("step")]
        ck = ckpt_restart.goodput(ck_steps, j.step_intervals())
        save_s = _measure_save_s(p.b6_size)
        k = max(1, int(round(sim.young_interval_s(save_s, interval) / step_ddp)))
        base_faults = [{"rank": r, "step": s} for r, s in zip(ranks, fault_steps)]
        t0 = time.monotonic()
        d = self.rundir("b6-restart")
        base = ckpt_restart.run_baseline(d, p.b6_size, 2, steps, k, base_faults)
        (d / "ckpt.pt").unlink(missing_ok=True)
        log(f"  b6-restart: {time.monotonic() - t0:.0f}s")
        cr = ckpt_restart.goodput(base.steps_log, base.step_intervals(without_saves=True))
        out = {
            "size": p.b6_size,
            "interval_s": interval,
            "failures": n,
            "steps": steps,
            "fault_steps": fault_steps,
            "ckptless": dict(ck, summary_goodput=j.summary["goodput"], recoveries=len(j.summary["recoveries"])),
            "ckpt_restart": dict(cr, ckpt_every=k, save_s=save_s, failures=len(base.failures)),
        }
        log(f"  goodput ckptless {100 * ck['goodput']:.1f}% vs checkpoint-restart {100 * cr['goodput']:.1f}% (K={k})")
        return out

    # ---------------------------------------------------------------- B6: at scale
    def b7(self) -> Dict[str, Any]:
        """B7: the real coordinator under simulated ranks (bench/b7.py), one run per world size."""
        p = self.plan
        points = []
        for n in p.b7_ranks:
            for control in p.b7_controls:  # side by side: the same world size with and without relays
                log(f"B7 coordinator at scale: {n} simulated ranks ({p.b7_wpn} per node), cluster.control={control}, steady window {p.b7_steady_s:.0f}s")
                t0 = time.monotonic()
                points.append(self.sim_point("b7", n, p.b7_steady_s, control))
                log(f"  b7-{n}-{control}: {time.monotonic() - t0:.0f}s: " + b7lib.one_line(points[-1]))
        metrics = b7lib.metrics_cost(self.rundir("b7-metrics"))
        log(f"  b7 metrics message: {metrics['at_1k_us']} us at step 1k, {metrics['at_1m_us']} us at step 1M")
        return {"points": points, "metrics": metrics, "targets": b7lib.TARGETS}

    def b8(self) -> Dict[str, Any]:
        log(f"B8 sharded state: {self.plan.b8_modes}, {self.plan.b8_size} model, replication factor 0/1/2")
        res = b8lib.run(self)
        log(b8lib.table(res))
        return res

    def b9(self) -> Dict[str, Any]:
        p = self.plan
        log(f"B9 elastic: {p.b9_size} model; train.reduction=fixed vs allreduce on 4 ranks ({p.b9_reps} pair(s) of {p.b9_steps} steps); "
            f"shrinks (nodes, min_nodes) {list(p.b9_shrinks)}, last node killed at step {p.b9_fault_step}, vs a spare's promotion")
        res = b9lib.run(self)
        log(b9lib.table(res))
        return res

    def copy_cost(self) -> Dict[str, Any]:
        """A shard copy's CPU against its floor, a holder landing it in fresh memory vs in the dropped copy's buffers (bench/copy_cost.py)."""
        sizes = {s: lm_params(s) if s in SIZES else int(float(s[:-1]) * 1e6) for s in self.plan.copy_cost_sizes}
        log(f"copy cost: {', '.join(f'{k} ({v / 1e6:.1f} M params)' for k, v in sizes.items())}, {self.plan.copy_cost_reps} copies of each landing, alternated")
        res = copy_cost_lib.measure(sizes, self.plan.copy_cost_reps)
        log(copy_cost_lib.table(res))
        return res

    def fsdp_warmup(self) -> Dict[str, Any]:
        """A hot spare's FSDP2 warm-up: the first ``fully_shard`` of a fresh process with and without it (bench/fsdp_warmup.py)."""
        reps = self.plan.fsdp_warmup_reps
        log(f"FSDP warm-up: {reps} fresh process(es) each, cold and warm alternated")
        res = fsdp_warmup_lib.measure(reps)
        log("  " + fsdp_warmup_lib.one_line(res))
        if not res["same_result"]:
            raise BenchError("FSDP warm-up: the first step after the warm-up differs from a cold process's: the warm-up left a trace. HINT: see samples[].params_sha256")
        return res

    def parallel(self, in_run: bool = False) -> Dict[str, Any]:
        """Tensor and pipeline parallel (issue 31): TP=2 and PP=2 x 2 replicas against the same
        layout in plain torch, and a killed TP/PP rank against a ddp promotion (bench/parallel_bench.py).
        ``in_run``: as a section of ``python -m bench``, where the quick smoke leaves it out: its
        quick variant is 11 jobs, 71 s on 2 idle cores (2026-12-05), more than the rest of the smoke
        can spare, and tests/bench/test_parallel_bench.py runs it already."""
        return self._standalone("parallel", parallel_lib, in_run, "tests/bench/test_parallel_bench.py")

    def _standalone(self, name: str, lib: Any, in_run: bool, smoke: str) -> Dict[str, Any]:
        """A section that is also a bench module of its own (``lib.measure(quick, tmp)``, ``lib.table``)."""
        quick = self.plan.name == "quick"
        if quick and in_run:
            return {"status": f"skipped: not in the quick run (python -m bench --only {name} --quick; {smoke} runs it)"}
        res = lib.measure(quick, self.tmp / name)
        log("\n" + lib.table(res))
        return res

    def b9_grow(self) -> Dict[str, Any]:
        """``--only b9_grow``: B9's grow-backs beside a spare's promotion, alone (bench/b9.py grow_only)."""
        res = b9lib.grow_only(self)
        log(b9lib.table(res))
        return res

    def moves(self, in_run: bool = False) -> Dict[str, Any]:
        """Planned moves (issue 33): a drain against a failure recovery of the same rank, a x3
        straggler under report and replace (bench/moves_bench.py). ``in_run``: as a section of
        ``python -m bench``, where the quick smoke leaves it out (tests/bench/test_moves_bench.py runs it)."""
        return self._standalone("moves", moves_lib, in_run, "tests/bench/test_moves_bench.py")

    def b6_sim(self, b1: Dict[str, Any], b3: Dict[str, Any], b5: Dict[str, Any]) -> Dict[str, Any]:
        pt = b1["points"][-1]  # the largest model measured
        per_doubling = b5lib.group_init_per_doubling_s(b5)  # B5's re-formation growth per doubling of the world
        costs = sim.Costs(
            detect_s=pt["hang"]["detect_s"],  # a crashed node says nothing: heartbeat detection
            reconfigure_s=pt["kill"]["reconfigure_s"],
            transfer_s=pt["kill"]["transfer_s"],
            resume_s=pt["kill"]["resume_s"],
            steady_overhead=max(0.0, b3["overhead_pct"] / 100.0),
            save_s=max(pt["ckpt_restart"]["save_s"], 1e-3),
            restart_s=pt["ckpt_restart"]["restart_s"],  # kill -> every rank ready again; Daly's model adds the redone work
            group_init_per_doubling_s=per_doubling,
            ref_gpus=2,
        )
        points = sim.sweep(costs, self.plan.sim_gpus)
        at16k = sim.compare(16384, costs)
        log("B6 at scale (ckptless_hpc.tools.sim, Llama 3 failure rate):\n" + sim.format_table(points))
        return {"source_size": pt["size"], "costs": costs.__dict__, "points": [q.as_dict() for q in points], "at_16k": at16k.as_dict()}


def _active_rank(cmd: str) -> bool:
    """A worker process of the two initial ranks (nodes local0, local1), not the spare."""
    return "ckptless_hpc.worker" in cmd and ("--node local0 " in cmd or "--node local1 " in cmd)


def _measure_save_s(size: str) -> float:
    """Median time of a durable torch.save of the model + AdamW state of ``size`` (3 tries)."""
    import tempfile

    import torch

    from ckptless_hpc.config import OptimConfig
    from ckptless_hpc.tasks.lm import LMTask

    from .plain_worker import save_checkpoint

    task = LMTask(**SIZES[size])
    model = task.build_model()
    opt = task.build_optimizer(model, OptimConfig())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()  # creates the AdamW moments
    times = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(3):
            t0 = time.monotonic()
            save_checkpoint(f"{d}/ckpt.pt", 1, model, opt)
            times.append(time.monotonic() - t0)
    return median(times)


def headline(res: Dict[str, Any]) -> Dict[str, Optional[float]]:
    b1p = res["b1"]["points"][0]
    b2 = res["b2"]
    return {
        "b1_downtime_s": _f(b1p["kill"]["downtime_s"]),
        "b1_ratio_vs_ckpt_restart": _f(b1p["ratio_kill"]),
        # checkpoint-restart's downtime over ours, both net of one step (issue 14)
        "b1_net_ratio_10m": _b1_net_ratio(res["b1"], "10M"),
        "b1_net_ratio_100m": _b1_net_ratio(res["b1"], "100M"),
        "b2_ratio_vs_torchft": _f(b2["ratio"]) if b2.get("status") == "ok" else None,
        "b3_overhead_pct": _f(res["b3"]["overhead_pct"]),
        "b4_transfer_fraction_of_loopback": _f(res["b4"]["fraction_of_loopback"]),
        "b4_sources_speedup_4_vs_1": _f(res["b4"]["sources"]["speedup_max_vs_1"]) if "sources" in res["b4"] else None,  # issue 14, loopback
        **{k: _f(v) for k, v in b5lib.headline(res.get("b5")).items()},  # a recovery's work vs the world: the coordinator's exponent, the survivor's growth
        "b6_goodput_local": _f(res["b6"]["ckptless"]["goodput"]),
        "b6_goodput_sim_16k": _f(res["b6_sim"]["at_16k"]["checkpointless_goodput"]),
        **b7lib.headline(res.get("b7")),
        **b8lib.headline(res.get("b8")),
        **b9lib.headline(res.get("b9")),
        **slurm_headline(res.get("b1_slurm")),
        **copy_cost_lib.headline(res.get("copy_cost")),
        **parallel_lib.headline(res.get("parallel")),
    }


def _b1_net_ratio(b1: Dict[str, Any], size: str) -> Optional[float]:
    p = next((q for q in b1["points"] if q["size"] == size), None)
    return None if p is None else _f(p["ratio_lost_time"])


def slurm_headline(b1s: Optional[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    ok = bool(b1s) and b1s.get("status") == "ok"
    return {
        "b1_slurm_node_crash_s": _f(b1s["crash"]["downtime_s"]) if ok else None,
        "b1_slurm_step_kill_s": _f(b1s["step"]["downtime_s"]) if ok else None,
    }


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return _f(x)
    return x


SECTIONS = ("b4", "b3", "b1", "b5", "b2", "b6", "b6_sim", "b7", "b8", "b9", "b1_slurm", "copy_cost", "parallel", "moves")


def _write(res: Dict[str, Any], results: Path) -> None:
    res = _clean(res)
    results.mkdir(parents=True, exist_ok=True)
    (results / "latest.json").write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    chart = report.chart(res, results / "latest.png")
    print(report.table(res))
    print(f"\nwrote {results / 'latest.json'}" + (f" and {chart}" if chart else " (no chart: matplotlib not installed; pip install -e '.[bench]')"))


def _resim(results: Path, plan: Plan) -> int:
    """Re-derive the pure parts (simulation, headline, table, chart) from saved measurements."""
    res = json.loads((results / "latest.json").read_text(encoding="utf-8"))
    plan = PLANS[res.get("mode", plan.name)]
    res["b6_sim"] = Bench(plan, results / "tmp").b6_sim(res["b1"], res["b3"], res["b5"])
    res.update(headline(res))
    res["resimulated"] = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": "python -m bench --resim"}
    _write(res, results)
    return 0


INDEPENDENT = ("b3", "b4", "b5", "b7", "b8", "b9", "b9_grow", "b1_slurm", "gloo_lazy", "fsdp_warmup", "copy_cost", "parallel", "moves")  # sections that use no other section's results


def _only(names: List[str], plan: Plan, results: Path, add_to_latest: bool = False) -> int:
    """Run a few sections alone (e.g. B3 after a change to the step); latest.json is left as it is."""
    bad = [n for n in names if n not in INDEPENDENT]
    if bad:
        print(f"python -m bench: --only {','.join(bad)}: not a section that runs alone. HINT: use one of {', '.join(INDEPENDENT)}, or the full run", file=sys.stderr)
        return 2
    tmp = results / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    b = Bench(plan, tmp)
    t0 = time.monotonic()
    command = f"python -m bench --only {','.join(names)}" + (" --quick" if plan.name == "quick" else "") + (" --add-to-latest" if add_to_latest else "")
    res: Dict[str, Any] = {"mode": plan.name, "command": command, "machine": machine_info(),
                           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    for name in names:
        res[name] = getattr(b, name)()
    res["elapsed_s"] = time.monotonic() - t0
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path = results / f"only-{'-'.join(names)}.json"
    path.write_text(json.dumps(_clean(res), indent=2) + "\n", encoding="utf-8")
    print(json.dumps({n: res[n] for n in names}, indent=2, default=str))
    if "b7" in names:
        print("\n" + b7lib.table(res["b7"]))
    for name in ("b9", "b9_grow"):
        if name in names:
            print("\n" + b9lib.table(res[name]))
    if "moves" in names:
        print("\n" + moves_lib.table(res["moves"]))
    if "b5" in names:
        print("\n" + b5lib.one_line(res["b5"]))
    if add_to_latest:
        _add_to_latest(res, names, results / "latest.json")
    print(f"\nwrote {path}")
    return 0


def _add_to_latest(res: Dict[str, Any], names: List[str], latest: Path) -> None:
    """Add these sections (and B7's headline keys) to latest.json, changing nothing else in it."""
    old = json.loads(latest.read_text(encoding="utf-8"))
    for n in names:
        old[n] = res[n]
        old[n]["measured"] = {"command": res["command"], "date": res["date"], "loadavg_at_end": res["machine"]["loadavg_at_end"],
                              "loadavg_at_start": res["machine"].get("loadavg_at_start"), "core_commit": res["machine"].get("core_commit")}
    if "b5" in names:
        for k in ("b5_growth_pct_2_to_8", "b5_growth_pct_net_2_to_8"):  # the earlier B5's keys: gone with its section
            old.pop(k, None)
        old.update(b5lib.headline(res["b5"]))
    if "b7" in names:
        old.update(b7lib.headline(res["b7"]))
    if "b8" in names:
        old.update(b8lib.headline(res["b8"]))
    if "b9" in names:
        old.update(b9lib.headline(res["b9"]))
    if "b9_grow" in names:
        old.update(b9lib.grow_headline(res["b9_grow"]))
    if "b1_slurm" in names:
        old.update(slurm_headline(res["b1_slurm"]))
    if "parallel" in names:
        old.update(parallel_lib.headline(res["parallel"]))
    latest.write_text(json.dumps(_clean(old), indent=2) + "\n", encoding="utf-8")
    print(f"added {', '.join(names)} to {latest}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the CI smoke: tiny sizes, one repetition, a few minutes")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help=f"results folder (default {DEFAULT_RESULTS.relative_to(REPO)})")
    ap.add_argument("--resim", action="store_true", help="measure nothing: recompute the simulation (B6 at scale), table and chart from DIR/latest.json")
    ap.add_argument("--add-to-latest", action="store_true", help="with --only: also add those sections (and their headline keys) to DIR/latest.json, leaving the rest of it as it is")
    ap.add_argument("--check", action="store_true", help="measure nothing: fail (exit 1) when README.md or a page of docs/ quotes a figure its JSON in DIR does not hold (bench/figures.py)")
    ap.add_argument("--render-docs", action="store_true", help="measure nothing: rewrite the tables of README.md and docs/*.md from the JSON in DIR, then --check")
    ap.add_argument("--doc", type=Path, action="append", help="with --check/--render-docs: only this page (repeatable; default README.md and every docs/*.md)")
    ap.add_argument("--only", default="", help=f"comma-separated sections that need no other ({', '.join(INDEPENDENT)}): run just those, write DIR/only-<names>.json")
    args = ap.parse_args(argv)
    plan = PLANS["quick" if args.quick else "full"]
    results = args.results.resolve()
    docs = args.doc[0] if args.doc and len(args.doc) == 1 else (args.doc or figures.pages(REPO))
    if args.check:
        return figures.main_check(docs, results, REPO)
    if args.render_docs:
        return figures.main_render(docs, results, REPO)
    if args.resim:
        return _resim(results, plan)
    if args.only:
        return _only(args.only.split(","), plan, results, args.add_to_latest)
    tmp = results / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    command = "python -m bench" + (" --quick" if args.quick else "") + ("" if results == DEFAULT_RESULTS else f" --results {args.results}")
    t_start = time.monotonic()
    res: Dict[str, Any] = {
        "mode": plan.name,
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "sizes": {k: dict(v, params=lm_params(k)) for k, v in SIZES.items()},
    }
    log(f"{plan.name} run; results in {results}")
    b = Bench(plan, tmp)
    steps: Dict[str, Callable[[], Dict[str, Any]]] = {
        "b4": b.b4,
        "b3": b.b3,
        "b1": lambda: b.b1(res["b4"]),
        "b5": b.b5,
        "b2": lambda: b.b2(res["b3"]),
        "b6": lambda: b.b6(res["b3"]),
        "b6_sim": lambda: b.b6_sim(res["b1"], res["b3"], res["b5"]),
        "b7": b.b7,
        "b8": b.b8,
        "b9": b.b9,
        "b1_slurm": b.b1_slurm,
        "copy_cost": b.copy_cost,
        "parallel": lambda: b.parallel(in_run=True),
        "moves": lambda: b.moves(in_run=True),
    }
    failed = []
    for name in SECTIONS:
        try:
            res[name] = steps[name]()
        except Exception as e:  # one broken section must not throw away the others' minutes of measurements
            log(f"{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            res[name] = {"status": f"error: {type(e).__name__}: {e}"[:1000]}
            failed.append(name)
    res["elapsed_s"] = time.monotonic() - t_start
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    try:
        res.update(headline(res))
    except (KeyError, TypeError) as e:  # a failed section's keys are missing: the sections are still written
        log(f"headline keys not computed ({type(e).__name__}: {e}): sections {', '.join(failed)} failed")
    if plan.b2_required and res.get("b2_ratio_vs_torchft") is None and "b2" not in failed:
        failed.append("b2")  # a full run has B2's ratio or it failed
    _write(res, results)
    if failed:
        log(f"python -m bench: sections {', '.join(failed)} failed (their 'status' in {results}/latest.json says why); the others were written")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
