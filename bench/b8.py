"""B8, sharded state (docs/sharding.md): what replication costs and what recovery of a shard takes.

- the per-step overhead of the copies: the same sharded mode with ``replication.factor`` 1 and
  2 against 0 (no copies), interleaved back-to-back runs, median wall time between committed
  steps, in % (2 nodes for factor 1, 3 nodes for factor 2: a copy must live on another node);
- the host memory the snapshots and held copies take per rank (summary.json ``parallel``);
- the time to recover a shard vs its size: a killed rank at two model sizes (its replacement
  fetches its shard from the holder's copy);
- HSDP's recovery downtime against DDP's on the same world (a lost rank's shard comes from the
  same index of another replica).

``python -m bench --only b8`` (``--quick`` for the smoke).
"""

from __future__ import annotations

from typing import Any, Dict, List

from .common import lm_params, median, task_overrides

NO_REFILL = ["cluster.refill_spares=false"]


def _interval(runs) -> float:
    return median([x for r in runs for x in r.step_intervals(skip=3)])


def overhead(bench: Any, mode: str, size: str, steps: int, reps: int, factors: Any = (1, 2)) -> List[Dict[str, Any]]:
    rows = []
    for nodes, factor in [(f + 1, f) for f in factors]:
        base = [*task_overrides(size), f"train.steps={steps}", f"parallel={mode}", f"cluster.nodes={nodes}", "cluster.spare_nodes=0"]
        none: List[Any] = []
        copies: List[Any] = []
        for rep in range(reps):  # back to back: the machine's load drifts
            none = bench.job(f"b8-{mode}-n{nodes}-f0", base + ["replication.factor=0"], rep + 1)
            copies = bench.job(f"b8-{mode}-n{nodes}-f{factor}", base + [f"replication.factor={factor}"], rep + 1)
        t0, t1 = _interval(none), _interval(copies)
        mem = copies[-1].summary.get("parallel", {}).get("copies_bytes_by_rank", {})
        rows.append(
            {
                "mode": mode, "size": size, "params": lm_params(size), "nodes": nodes, "factor": factor,
                "step_s_no_copies": t0, "step_s_copies": t1, "overhead_pct": 100.0 * (t1 / t0 - 1.0),
                "copies_mb_per_rank": median([(v["own"] + v["held"]) / 1e6 for v in mem.values()]) if mem else None,
                "held_mb_per_rank": median([v["held"] / 1e6 for v in mem.values()]) if mem else None,
            }
        )
    return rows


def recover(bench: Any, mode: str, size: str, steps: int, fault_step: int) -> Dict[str, Any]:
    over = [*task_overrides(size), f"train.steps={steps}", f"parallel={mode}", "fault=kill_worker", "fault.rank=1", f"fault.step={fault_step}", *NO_REFILL]
    run = bench.job(f"b8-recover-{mode}-{size}", over)[0]
    r = run.summary["recoveries"][0]
    return {
        "mode": mode, "size": size, "params": lm_params(size), "shard_mb": r["bytes_transferred"] / 1e6, "transfer_s": r["transfer_s"],
        "downtime_s": r["downtime_s"], "target_step": r["target_step"], "oracle_final_sha": run.summary["final_state_sha256"],
    }


def hsdp_vs_ddp(bench: Any, size: str, steps: int, fault_step: int, reps: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"size": size}
    for mode in ("ddp", "hsdp"):
        over = [*task_overrides(size), f"train.steps={steps}", f"parallel={mode}", "cluster.workers_per_node=2", "fault=kill_worker", "fault.rank=1",
                f"fault.step={fault_step}", *NO_REFILL]
        runs = bench.job(f"b8-downtime-{mode}", over, reps)
        out[mode] = {
            "downtime_s": median([r.summary["recoveries"][0]["downtime_s"] for r in runs]),
            "transfer_s": median([r.summary["recoveries"][0]["transfer_s"] for r in runs]),
            "mb_moved": median([r.summary["recoveries"][0]["bytes_transferred"] / 1e6 for r in runs]),
        }
    out["ratio_hsdp_over_ddp"] = out["hsdp"]["downtime_s"] / out["ddp"]["downtime_s"] if out["ddp"]["downtime_s"] else None
    return out


def run(bench: Any) -> Dict[str, Any]:
    p = bench.plan
    res: Dict[str, Any] = {"overhead": [], "recover": []}
    for mode in p.b8_modes:
        res["overhead"] += overhead(bench, mode, p.b8_size, p.b8_steps, p.b8_reps, p.b8_factors)
        for size in p.b8_recover_sizes:
            res["recover"].append(recover(bench, mode, size, p.b8_recover_steps, p.b8_recover_steps // 2))
    if "hsdp" in p.b8_modes_available:
        res["hsdp_vs_ddp"] = hsdp_vs_ddp(bench, p.b8_recover_sizes[0], p.b8_recover_steps, p.b8_recover_steps // 2, p.b8_reps)
    return res


def table(res: Dict[str, Any]) -> str:
    lines = ["B8 sharded state", "mode  params  nodes factor  step no copies  step copies  overhead  copies MB/rank"]
    for r in res["overhead"]:
        lines.append(
            f"{r['mode']:<5} {r['params'] / 1e6:6.1f}M {r['nodes']:5d} {r['factor']:6d} {r['step_s_no_copies']:13.3f}s {r['step_s_copies']:11.3f}s "
            f"{r['overhead_pct']:+8.1f}%  {r['copies_mb_per_rank'] or 0:8.1f}"
        )
    lines.append("mode  params  shard MB  transfer s  downtime s")
    for r in res["recover"]:
        lines.append(f"{r['mode']:<5} {r['params'] / 1e6:6.1f}M {r['shard_mb']:9.1f} {r['transfer_s']:10.3f} {r['downtime_s']:11.3f}")
    h = res.get("hsdp_vs_ddp")
    if h:
        lines.append(f"downtime of a killed rank: ddp {h['ddp']['downtime_s']:.3f}s, hsdp {h['hsdp']['downtime_s']:.3f}s (x{h['ratio_hsdp_over_ddp']:.2f})")
    return "\n".join(lines)


def headline(res: Any) -> Dict[str, Any]:
    rows = [r for r in (res or {}).get("overhead", []) if r["factor"] == 1]
    return {"b8_replication_overhead_pct_f1": rows[0]["overhead_pct"] if rows else None}
