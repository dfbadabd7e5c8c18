"""The table printed at the end of a run and the PNG chart, both from the results dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import ms_or_na, verdict


def _s(x: Optional[float], unit: str = "s", digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{unit}"


def _pct(x: Optional[float], digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def _pp(x: Optional[float]) -> str:
    """A signed percentage, already in percent."""
    return "n/a" if x is None else f"{x:+.1f}%"


def _ok(cond: Optional[bool]) -> str:
    return "n/a" if cond is None else ("yes" if cond else "NO")


def rows(res: Dict[str, Any]) -> List[List[str]]:
    out: List[List[str]] = []
    for p in res["b1"]["points"]:
        k, h, c = p["kill"], p["hang"], p["ckpt_restart"]
        sp = p.get("spread", {})
        oracle = p.get("oracle")
        out.append([
            f"B1 kill, {p['size']} ({p['params'] / 1e6:.1f} M params, state {p['state_bytes'] / 1e6:.0f} MB)",
            f"{_reps(p['reps'])}ckptless {_s(k['downtime_s'])}{_range(sp.get('kill_downtime_s'))} (detect {_s(k['detect_s'], '', 3)} + reconf {_s(k['reconfigure_s'], '', 3)} + transfer "
            f"{_s(k['transfer_s'], '', 3)} + first step {_s(k['resume_s'], '', 2)}) vs checkpoint-restart {_s(c['downtime_s'])}{_range(sp.get('ckpt_restart_downtime_s'))} "
            f"(restart {_s(c['restart_s'])}, first step {_s(c['first_step_s'])} after the kill, {c['lost_steps']:.0f} steps redone): {_s(p['ratio_kill'], 'x', 1)}; "
            f"net of one step ({_s(p['step_s'])}): {_s(p['ckptless_lost_s'])} vs {_s(p['ckpt_restart_lost_s'])} = {_s(p['ratio_lost_time'], 'x', 0)}; "
            f"oracle {'not checked' if oracle is None else ('held' if oracle else 'BROKEN')}",
            f">=20x; <= {_s(p['target_bound_s'])}",
            f"{_ok(p['ratio_kill'] >= 20)} ({_ok(p['ratio_lost_time'] >= 20)} net); {_ok(k['downtime_s'] <= p['target_bound_s'])}",
        ])
        out.append([
            f"B1 hang, {p['size']}",
            f"ckptless {_s(h['downtime_s'])}{_range(p.get('spread', {}).get('hang_downtime_s'))} (detect {_s(h['detect_s'])} = heartbeat timeout, reconf {_s(h['reconfigure_s'], '', 3)}, "
            f"transfer {_s(h['transfer_s'], '', 3)}, first step {_s(h['resume_s'])})",
            "-", "-",
        ])
    out += b1_slurm_rows(res.get("b1_slurm"))
    b2 = res["b2"]
    if b2.get("status") == "ok":
        ft = b2["torchft"]
        over = b2.get("torchft_overhead_pct")
        ours = b2.get("ckptless_overhead_pct")
        out.append([
            f"B2 TorchFT, {b2['size']} model, kill",
            f"TorchFT {_s(ft['downtime_s'])} (relaunch, import {_s(ft['imported_s'])}, build {_s(ft['built_s'])}, heal + step) vs ckptless "
            f"{_s(b2['ckptless_downtime_s'], 's', 3)}: {_s(b2['ratio'], 'x', 0)}; step overhead vs DDP TorchFT "
            f"{'n/a' if over is None else f'{over:+.1f}%'} / ckptless {'n/a' if ours is None else f'{ours:+.1f}%'}",
            ">=10x; lower overhead",
            f"{_ok(b2['ratio'] >= 10)}; {_ok(None if over is None or ours is None else ours < over)}",
        ])
    else:
        out.append(["B2 TorchFT", b2.get("status", "skipped"), ">=10x", "n/a"])
    b3 = res["b3"]
    out.append([
        f"B3 steady state, {b3['size']} model, 2 workers",
        f"ckptless {1e3 * b3['ckptless_step_s']:.1f} ms/step vs DDP {1e3 * b3['ddp_step_s']:.1f} ms/step: {b3['overhead_pct']:+.1f}% (median of "
        f"{b3['reps']} back-to-back pairs{_pairs(b3.get('pair_ratios'))}); CPU s/step: ranks {_pp(b3['cpu_overhead_ranks_pct'])}, + coordinator and spare {_pp(b3['cpu_overhead_all_pct'])}",
        "<=2%", verdict([100.0 * (r - 1.0) for r in b3["pair_ratios"]], 2.0) if b3.get("pair_ratios") else _ok(b3["overhead_pct"] <= 2.0),
    ])
    b4 = res["b4"]
    out.append([
        f"B4 transfer, {b4['bytes'] / 1e6:.0f} MB",
        f"state {b4['state_transfer_gbps']:.2f} GB/s vs raw TCP {b4['raw_tcp_gbps']:.2f} GB/s ({b4.get('checksum', 'crc32')} {b4.get('checksum_gbps', b4['crc32_gbps']):.1f} GB/s, "
        f"first touch {b4['first_touch_gbps']:.1f} GB/s{', into a pre-touched arena' if b4.get('arena') else ''})",
        ">=70%", f"{_pct(b4['fraction_of_loopback'], 0)}: {_ok(b4['fraction_of_loopback'] >= 0.7)}",
    ])
    out += b5_rows(res["b5"])
    b6 = res["b6"]
    out.append([
        f"B6 local goodput, a kill every {b6['interval_s']:.0f}s",
        f"ckptless {_pct(b6['ckptless']['goodput'])} vs checkpoint-restart {_pct(b6['ckpt_restart']['goodput'])} (K={b6['ckpt_restart']['ckpt_every']} steps, Young)",
        ">=97%", _ok(b6["ckptless"]["goodput"] >= 0.97),
    ])
    s16 = res["b6_sim"]["at_16k"]
    out.append([
        "B6 simulated, 16,384 GPUs (Llama 3 failure rate)",
        f"ckptless {_pct(s16['checkpointless_goodput'], 2)} vs checkpoint-restart {_pct(s16['ckpt_restart_goodput'], 2)} "
        f"(interval {s16['interval_s']:.0f}s, MTBF {s16['mtbf_s'] / 3600:.1f} h); ckptless x (1 - B3 overhead) {_pct(s16.get('checkpointless_throughput'), 2)}",
        ">=98%", _ok(s16["checkpointless_goodput"] >= 0.98),
    ])
    out += b7_rows(res.get("b7"))
    out += b8_rows(res.get("b8"))
    out += b9_rows(res.get("b9"))
    out += parallel_rows(res.get("parallel"))
    out += moves_rows(res.get("moves"))
    return out


def moves_rows(mv: Optional[Dict[str, Any]]) -> List[List[str]]:
    """Planned moves (bench/moves_bench.py): a drain against a recovery of the same rank, a x3 straggler reported or replaced."""
    if not mv or "move_downtime_s" not in mv:
        return [["Planned moves", mv.get("status", "skipped"), "-", "n/a"]] if mv else []
    out = [[
        f"Planned move (drain) vs recovery of the same rank, {mv['size']} LM, ddp",
        f"{_reps(mv['reps'])}downtime {_s(mv['move_downtime_s'], 's', 3)} vs kill_worker {_s(mv['recovery_downtime_s'], 's', 3)}: x{mv['move_over_recovery']:.2f}; "
        f"steps redone by the moves {mv['moves_redone_steps']}; oracle {'held' if mv['oracle'] else 'BROKEN'}",
        "no step redone", _ok(mv["moves_redone_steps"] == 0),
    ]]
    s = mv.get("straggler")
    if s:
        out.append([
            f"Straggler x3, {s['report']['steps']} steps",
            f"report {_s(s['report']['train_s'], 's', 1)}, replace {_s(s['replace']['train_s'], 's', 1)} ({s['replace']['moves']} move), healthy {_s(s['healthy']['train_s'], 's', 1)}: "
            f"replace x{mv['replace_speedup']:.2f} faster",
            "-", "-",
        ])
    return out


def _reps(n: int) -> str:
    return "1 run: " if n <= 1 else f"median of {n} runs: "


def _range(sp: Optional[Dict[str, Any]]) -> str:
    """" (min-max)" of repetitions, nothing for one."""
    return "" if not sp or sp.get("n", 1) <= 1 else f" ({sp['min']:.2f}-{sp['max']:.2f})"


def _pairs(ratios: Optional[List[float]]) -> str:
    return f", pairs {min(ratios):.3f}-{max(ratios):.3f}" if ratios else ""


def b5_rows(b5: Dict[str, Any]) -> List[List[str]]:
    """B5: a recovery's work for the coordinator and a survivor as the world grows (bench/b5.py),
    one row per control; a JSON of the earlier B5 (real workers at 2-8) as it was shown."""
    if "rows" not in b5:
        return [["B5 a recovery's work vs the world", b5.get("status", "skipped"), "-", "n/a"]]
    if b5["rows"] and "workers" in b5["rows"][0]:
        parts = ", ".join(f"{r['workers']}: {_s(r['downtime_s'], 's', 3)} (step {1e3 * r['step_s']:.0f} ms)" for r in b5["rows"])
        return [[
            f"B5 scaling, {b5['size']} model",
            f"downtime {parts}; growth excl. first step {b5['growth_excl_resume_pct']:+.0f}%, in units of the step time {b5['growth_in_steps_pct']:+.0f}%",
            f"<=10% ({b5['from_to'][0]}->{b5['from_to'][1]})", f"{b5['growth_pct']:+.0f}%: {_ok(b5['growth_pct'] <= 10)}",
        ]]
    t = b5["targets"]
    out = []
    for control, g in b5["growth"].items():
        rs = [r for r in b5["rows"] if r["control"] == control]
        lo, hi = rs[0], rs[-1]
        ce, sg = g["coordinator_exponent"], g["survivor_bytes_growth_pct"]
        out.append([
            f"B5 a recovery's work, {lo['ranks']:,} -> {hi['ranks']:,} simulated ranks, control={control}",
            f"coordinator CPU {lo['coordinator_cpu_ms']:.0f} -> {hi['coordinator_cpu_ms']:.0f} ms ({lo['coordinator_cpu_us_per_rank']:.0f} -> "
            f"{hi['coordinator_cpu_us_per_rank']:.0f} us per rank; exponent {'n/a' if ce is None else f'{ce:.2f}'}); a survivor: {lo['survivor_messages']:.0f} -> "
            f"{hi['survivor_messages']:.0f} messages, {lo['survivor_bytes']:.0f} -> {hi['survivor_bytes']:.0f} bytes ({'n/a' if sg is None else f'{sg:+.1f}%'})",
            f"survivor flat (<= {t['survivor_bytes_growth_pct']:.0f}%); coordinator <= linear (exponent <= {t['coordinator_exponent']})",
            f"{_ok(g['survivor_flat'])}; {_ok(g['coordinator_at_most_linear'])}",
        ])
    return out


def b8_rows(b8: Optional[Dict[str, Any]]) -> List[List[str]]:
    """B8 at factor 1: the copies' overhead (median of pairs) and what the copy costs against its floor."""
    out: List[List[str]] = []
    for r in (b8 or {}).get("overhead", []):
        if r["factor"] != 1:
            continue
        f = r.get("floor") or {}
        floor = ""
        if "blocked_pct_of_step" in f:
            cpu = f.get("cpu_over_floor")
            floor = (f"; blocked on the copy's acks {f['blocked_pct_of_step']:.1f}% of the step; copy CPU {ms_or_na(f['copy_cpu_s_per_step'], 0)} ms/step vs "
                     f"memcpy + loopback {1e3 * f['floor_s_per_step']:.0f} ms: {'n/a' if cpu is None else f'x{cpu:.2f}'}")
        out.append([
            f"B8 copies, {r['mode']}, {r['params'] / 1e6:.1f} M, factor 1",
            f"step {_s(r['step_s_no_copies'], 's', 3)} -> {_s(r['step_s_copies'], 's', 3)}: {_pp(r['overhead_pct'])} ({'median of pairs' + _pairs(r['pair_ratios']) if r.get('pair_ratios') else 'pooled'}){floor}",
            "<=3%; blocked <=3%; CPU <= x1.3",
            f"{r.get('verdict', 'n/a')}; {_ok(f.get('blocked_reached'))}; {_ok(f.get('cpu_reached'))}",
        ])
    return out


def b9_rows(b9: Optional[Dict[str, Any]]) -> List[List[str]]:
    """B9 (elastic): the fixed-order reduction's overhead, each shrink's degraded step, the shrink's downtime vs a spare's promotion."""
    if not b9 or "overhead" not in b9:
        return [["B9 elastic", b9.get("status", "skipped"), "-", "n/a"]] if b9 else []
    o = b9["overhead"]
    out = [[
        f"B9 train.reduction=fixed vs allreduce, {o['params'] / 1e6:.1f} M, {o['ranks']} ranks",
        f"step {_s(o['allreduce_step_s'], 's', 3)} -> {_s(o['fixed_step_s'], 's', 3)}: {_pp(o['overhead_pct'])} ({'median of pairs' + _pairs(o['pair_ratios'])}); "
        f"in-step {_pp(o['in_step_overhead_pct'])}; CPU s/step of the ranks {_pp(o.get('cpu_overhead_pct'))}",
        f"<=+{o['target_pct']:.0f}%", o["verdict"],
    ]]
    for pt in b9["shrink"]:
        cpu = pt.get("cpu_ratio")
        out.append([
            f"B9 shrink {pt['nodes']} -> {pt['live_after']} processes, {pt['params'] / 1e6:.1f} M",
            f"{_reps(pt['reps'])}step {_s(pt['step_s_before'], 's', 3)} -> {_s(pt['step_s_after'], 's', 3)}: x{pt['slowdown']:.2f} vs ideal x{pt['ideal_slowdown']:.2f} "
            f"(V / live) {_pp(pt['vs_ideal_pct'])}, vs the busiest process's share x{pt['bound_slowdown']} {_pp(pt['vs_bound_pct'])}; "
            f"workers' CPU per step after/before {'n/a' if cpu is None else f'x{cpu:.2f}'}; oracle {'held' if pt['shrink']['oracle'] else 'BROKEN'}",
            "-", "-",
        ])
        if "promotion" in pt:
            s, q = pt["shrink"], pt["promotion"]
            out.append([
                f"B9 shrink vs spare promotion, {pt['nodes']} nodes",
                f"{_reps(pt['reps'])}shrink {_s(s['downtime_s'], 's', 3)}{_range(s.get('spread'))} (detect {_s(s['detect_s'], '', 3)} + reconf {_s(s['reconfigure_s'], '', 3)} + "
                f"transfer {_s(s['transfer_s'], '', 3)} + first step {_s(s['resume_s'], '', 3)}) vs promotion {_s(q['downtime_s'], 's', 3)}{_range(q.get('spread'))} "
                f"(detect {_s(q['detect_s'], '', 3)} + reconf {_s(q['reconfigure_s'], '', 3)} + transfer {_s(q['transfer_s'], '', 3)} + first step {_s(q['resume_s'], '', 3)}): "
                f"x{pt['shrink_over_promotion']:.2f}; oracle {'held' if s['oracle'] and q['oracle'] else 'BROKEN'}",
                "-", "-",
            ])
    for g in b9.get("grow", []):
        s, q = g["shrink"], g["grow"]
        out.append([
            f"B9 shrink then grow back, parallel={g['mode']}, {g['nodes']} nodes",
            f"{_reps(g['reps'])}shrink {_s(s['downtime_s'], 's', 3)}{_range(s.get('spread'))} (net of its first step {_s(s['recovery_s'], 's', 3)}, "
            f"{s['bytes_transferred'] / 1e6:.1f} MB moved), grow back {_s(q['downtime_s'], 's', 3)}{_range(q.get('spread'))} (net {_s(q['recovery_s'], 's', 3)}, "
            f"{q['bytes_transferred'] / 1e6:.1f} MB to the refill); degraded {g['degraded_s']:.1f} s; oracle {'held' if g['oracle'] else 'BROKEN'}",
            "-", "-",
        ])
    return out


def parallel_rows(par: Optional[Dict[str, Any]]) -> List[List[str]]:
    """Tensor and pipeline parallel (bench/parallel_bench.py): each layout's step against plain torch, then a lost rank's recovery."""
    if not par:
        return []
    if "tp" not in par or "recovery" not in par:
        return [["TP / PP vs plain torch (issue 31)", par.get("status", "skipped"), "<=2%", "n/a"]]
    out = []
    for mode, name in (("tp", "TP=2"), ("pp", f"PP=2 ({par['pp_schedule']}, {par['pp_micro_batches']} micro-batches)")):
        s = par[mode]
        ratios = [1.0 + x / 100.0 for x in s["pair_overheads_pct"]]
        out.append([
            f"{name} x 2 replicas vs plain torch, {par['params'] / 1e6:.2f} M",
            f"ckptless {1e3 * s['ckptless_step_s']:.1f} ms/step vs plain {1e3 * s['plain_step_s']:.1f} ms/step: {_pp(s['overhead_pct'])} "
            f"(median of {len(ratios)} back-to-back pairs{_pairs(ratios)}); CPU s/step of the ranks {_pp(s.get('cpu_overhead_pct'))}",
            f"<={par['target_pct']:.0f}%", s["verdict"],
        ])
    r = par["recovery"]
    out.append([
        "TP / PP lost rank vs ddp promotion",
        f"downtime TP {_s(r['tp']['downtime_s'])}, PP {_s(r['pp']['downtime_s'])} vs ddp {_s(r['ddp']['downtime_s'])} (whole state first {_s(r['ddp_whole']['downtime_s'])}); "
        f"moved TP {r['tp']['bytes_ratio_vs_ddp']:.2f}x, PP {r['pp']['bytes_ratio_vs_ddp']:.2f}x ddp's whole state; oracle {'held' if par['oracle'] else 'BROKEN'}",
        "only the lost coordinate's shard", "-",
    ])
    return out


def b1_slurm_rows(b1s: Optional[Dict[str, Any]]) -> List[List[str]]:
    """B1 on the Slurm mini-cluster: a crashed node and a killed step vs the local killed worker."""
    if not b1s:
        return []
    if b1s.get("status") != "ok":
        return [["B1 Slurm (mini-cluster)", b1s.get("status", "skipped"), "-", "n/a"]]
    ref, t = b1s["local_kill"], b1s["target_s"]
    rows_ = []
    for kind, label in (("crash", "crashed node"), ("step", "killed step")):
        p = b1s[kind]
        over = p["downtime_s"] - ref["downtime_s"]
        rows_.append([
            f"B1 Slurm {label}, {b1s['size']} model",
            f"{_s(p['downtime_s'], 's', 3)} from the fault (to detection {_s(p['fault_to_detect_s'], '', 3)}, reconf {_s(p['reconfigure_s'], '', 3)}, "
            f"transfer {_s(p['transfer_s'], '', 3)}, first step {_s(p['resume_s'], '', 3)}) vs local killed worker {_s(ref['downtime_s'], 's', 3)}: "
            f"{over:+.3f}s; scancel of the dead step {_s(p['scancel_s'])} after the promotion, loop stall {_s(p['coordinator_worst_stall_s'], 's', 2)}; "
            f"oracle {'held' if p['oracle'] else 'BROKEN'} ({p['reps']} runs)",
            f"<= local + {t:.1f}s", _ok(over <= t),
        ])
    return rows_


def b7_rows(b7: Optional[Dict[str, Any]]) -> List[List[str]]:
    """B7 (the coordinator under simulated ranks): one row per world size."""
    if not b7:
        return []
    t = b7["targets"]
    rows_ = []
    for p in b7["points"]:
        met = [p["cpu_pct"] <= t["cpu_pct"], p["hb_delay_p99_ms"] <= t["hb_delay_p99_ms"], p["assign_ms"] <= t["assign_ms"],
               p["startup_lost"] == 0, p["false_failures"] == 0]
        rows_.append([
            f"B7 coordinator, {p['ranks']:,} simulated ranks, control={p.get('control', 'rank')}",
            f"CPU {p['cpu_pct']:.1f}% of a core; heartbeat delay p99 {p['hb_delay_p99_ms']:.0f} ms; closed -> last assign {p['assign_ms']:.0f} ms, "
            f"re-formed {p['reformed_ms']:.0f} ms; start-up {p['startup_s']:.1f}s, {p['startup_lost']} lost; {p['false_failures']} false failures",
            f"at 10k: <={t['cpu_pct']:.0f}%, <={t['hb_delay_p99_ms']:.0f} ms, <={t['assign_ms']:.0f} ms, 0 lost, 0 false",
            "; ".join(_ok(m) for m in met),
        ])
    m = b7.get("metrics")
    if m:
        rows_.append(["B7 metrics message at step 1M vs 1k", f"{m['at_1m_us']} us vs {m['at_1k_us']} us: x{m['ratio_1m_vs_1k']}",
                      f"<= x{t['metrics_ratio_1m_vs_1k']}", _ok(m["ratio_1m_vs_1k"] <= t["metrics_ratio_1m_vs_1k"])])
    return rows_


def table(res: Dict[str, Any]) -> str:
    head = ["benchmark", "measured (side by side; medians where repeated)", "target", "reached"]
    body = rows(res)
    w = [max(len(r[i]) for r in [head] + body) for i in range(3)]
    line = lambda r: f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}"  # noqa: E731
    m = res["machine"]
    return "\n".join(
        [f"ckptless_hpc benchmarks ({res['mode']}): {res['command']}  [{res['date']}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}]", line(head), "-" * (sum(w) + 14)]
        + [line(r) for r in body]
    )


def markdown(res: Dict[str, Any]) -> str:
    """The same table in Markdown (docs/benchmarks.md)."""
    out = ["| benchmark | measured (side by side; medians where repeated) | target | reached |", "| --- | --- | --- | --- |"]
    out += [f"| {' | '.join(c.replace('|', '/') for c in r)} |" for r in rows(res)]
    return "\n".join(out)


def chart(res: Dict[str, Any], path: Path) -> Optional[Path]:
    """A 2x2 PNG: B1 downtimes, B5 scaling, B3/B4 bars, B6 goodput vs GPUs. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    # B1 + B2: downtime per failure, log scale
    labels, ck, cr = [], [], []
    for p in res["b1"]["points"]:
        labels += [f"kill {p['size']}", f"hang {p['size']}"]
        ck += [p["kill"]["downtime_s"], p["hang"]["downtime_s"]]
        cr += [p["ckpt_restart"]["downtime_s"], None]
    x = range(len(labels))
    a = ax[0][0]
    a.bar([i - 0.2 for i in x], ck, width=0.4, label="ckptless_hpc", color="tab:green")
    a.bar([i + 0.2 for i in x], [v or 0 for v in cr], width=0.4, label="checkpoint-restart", color="tab:red")
    b2 = res["b2"]
    if b2.get("status") == "ok":
        n = len(labels)
        a.bar([n - 0.2], [b2["ckptless_downtime_s"]], width=0.4, color="tab:green")
        a.bar([n + 0.2], [b2["torchft"]["downtime_s"]], width=0.4, color="tab:blue", label="TorchFT")
        labels.append(f"kill {b2['size']} (B2)")
    a.set_xticks(range(len(labels)), labels, rotation=15)
    a.set_yscale("log")
    a.set_ylabel("downtime per failure (s, log)")
    a.set_title("B1/B2: failure -> first committed step past it")
    a.legend()
    # B5
    a = ax[0][1]
    rows5 = res["b5"].get("rows", [])
    if rows5 and "workers" in rows5[0]:  # the earlier B5 (real workers)
        w = [r["workers"] for r in rows5]
        a.plot(w, [r["downtime_s"] for r in rows5], "o-", label="downtime", color="tab:green")
        a.plot(w, [r["recovery_excl_resume_s"] for r in rows5], "s--", label="detect+reconfigure+transfer", color="tab:olive")
        a.set_xlabel("workers (2 CPU cores)")
        a.set_ylabel("seconds")
        a.set_title("B5: recovery vs worker count")
    elif rows5:
        for control, color in (("node", "tab:green"), ("rank", "tab:olive")):
            rs = [r for r in rows5 if r["control"] == control]
            if rs:
                a.plot([r["ranks"] for r in rs], [r["coordinator_cpu_ms"] for r in rs], "o-", color=color, label=f"coordinator CPU (ms), control={control}")
                a.plot([r["ranks"] for r in rs], [r["survivor_bytes"] / 1000 for r in rs], "s--", color=color, label=f"a survivor's messages (kB), control={control}")
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("simulated ranks")
        a.set_title("B5: one recovery's work vs the world")
    a.legend()
    # B3 + B4
    a = ax[1][0]
    b3, b4 = res["b3"], res["b4"]
    names = ["DDP", "ckptless"] + (["TorchFT"] if b3.get("torchft_step_s") else [])
    vals = [1e3 * b3["ddp_step_s"], 1e3 * b3["ckptless_step_s"]] + ([1e3 * b3["torchft_step_s"]] if b3.get("torchft_step_s") else [])
    a.bar(names, vals, color=["tab:gray", "tab:green", "tab:blue"][: len(names)])
    a.set_ylabel(f"ms per step ({b3['size']} model, 2 workers)")
    a.set_title(f"B3: step time; B4: transfer {b4['state_transfer_gbps']:.2f} vs raw TCP {b4['raw_tcp_gbps']:.2f} GB/s")
    # B6
    a = ax[1][1]
    pts = res["b6_sim"]["points"]
    g = [p["gpus"] for p in pts]
    a.plot(g, [100 * p["checkpointless_goodput"] for p in pts], "o-", color="tab:green", label="ckptless_hpc goodput")
    if all(p.get("checkpointless_throughput") is not None for p in pts):
        a.plot(g, [100 * p["checkpointless_throughput"] for p in pts], "o--", color="tab:olive", label="ckptless_hpc x (1 - B3 step overhead)")
    a.plot(g, [100 * p["ckpt_restart_goodput"] for p in pts], "o-", color="tab:red", label="checkpoint-restart, optimal interval")
    a.set_xscale("log")
    a.set_xlabel("GPUs (Llama 3 failure rate)")
    a.set_ylabel("goodput (%)")
    b6 = res["b6"]
    a.set_title(f"B6: simulated; local (kill every {b6['interval_s']:.0f}s): {100 * b6['ckptless']['goodput']:.1f}% vs {100 * b6['ckpt_restart']['goodput']:.1f}%")
    a.axhline(98, color="k", lw=0.5, ls=":")
    a.legend()
    fig.suptitle(f"ckptless_hpc benchmarks ({res['mode']}, {res['date']}, {res['machine']['cores']} CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":  # python -m bench.report [bench/results/latest.json]: the Markdown table
    import json
    import sys

    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "latest.json")
    print(markdown(json.loads(src.read_text(encoding="utf-8"))))
