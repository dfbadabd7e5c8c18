"""B5: the work of one recovery as the world grows, for the coordinator and for a survivor.

The earlier B5 killed a worker of jobs of 2, 4 and 8 real processes on this 2-core machine: at 8
workers, a spare and the coordinator every message waited for a core, and its growth measured
the machine's CPU share, not the design. This one holds on any machine: B7's real coordinator
(``bench/b7_coord.py``) under simulated ranks (``bench/b7_ranks.py``, 8 per node, one spare
node), one rank's connection closed, at world sizes from tens to thousands of ranks, with relays
(``cluster.control=node``) and without, side by side with what one survivor does in the same
recovery:

- **the coordinator**: its CPU time in the recovery, from the close to the first step resumed,
  less its steady rate (heartbeats, metrics) over the same wall time (``recovery_cpu_net_ms``),
  and the time to the last ``assign`` received and to the re-formed group;
- **a survivor** (rank 1 of node 0: neither rank 0, which reports every step, nor on the
  victim's node): the control messages it receives and sends from the close on (abort, held,
  assign, joining, ready: heartbeats and metrics left out), counted and in bytes.

How each grows is a least-squares slope on log-log axes between world sizes (``exponent``: 0 is
flat, 1 is linear in the ranks, which at a fixed number of ranks per node is O(nodes)). The
design's claim: a survivor's share is flat (its messages name no other rank: one rankless
``assign``, at most 4 sources), the coordinator's is at most linear (every rank's ``held``,
``joining`` and ``ready`` are read once; with relays in one frame per node). Not simulated: the
new gloo group's own connections (eager setup connects each rank to every other, the
``gloo_lazy`` section measured 2-8 real workers) and the state transfer (B1, B4).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence


# the targets: a survivor's share flat within 10 % from the smallest world to the largest, the
# coordinator's CPU per recovery no worse than linear (a slope of 1.2 leaves room for noise)
TARGETS = {"survivor_bytes_growth_pct": 10.0, "coordinator_exponent": 1.2}


def exponent(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """The least-squares slope of log(y) on log(x): how y grows with x (None without two
    distinct x, or with a y that is not positive)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len({p[0] for p in pts}) < 2 or len(pts) < len(xs):
        return None
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def row(control: str, ranks: int, points: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One world size with one ``control``: medians over its repetitions."""
    med = lambda key: statistics.median(p[key] for p in points)  # noqa: E731
    surv = [p["survivor"] for p in points if p.get("survivor")]
    out = {
        "control": control,
        "ranks": ranks,
        "nodes": ranks // points[0]["workers_per_node"],
        "reps": len(points),
        "coordinator_cpu_ms": max(0.1, med("recovery_cpu_net_ms")),  # 0.1 ms: below it, the steady rate's subtraction is the noise
        "coordinator_cpu_gross_ms": med("recovery_cpu_ms"),
        "coordinator_steady_cpu_pct": med("cpu_pct"),
        "assign_ms": med("assign_ms"),
        "reformed_ms": med("reformed_ms"),
        "survivor_messages": statistics.median(s["messages"] for s in surv) if surv else None,
        "survivor_bytes": statistics.median(s["bytes"] for s in surv) if surv else None,
        "survivor_by_type": surv[0]["by_type"] if surv else None,
        "false_failures": sum(p["false_failures"] for p in points),
        "startup_lost": sum(p["startup_lost"] for p in points),
    }
    out["coordinator_cpu_us_per_rank"] = 1000.0 * out["coordinator_cpu_ms"] / ranks
    return out


def summarize(points: Dict[str, Dict[int, List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """``points``: control -> ranks -> the B7 points of that world size. The rows, and per
    control how the coordinator's and the survivor's work grow (exponents, the survivor's bytes
    from the smallest world to the largest) against the targets."""
    rows = [row(c, n, pts) for c, by_n in points.items() for n, pts in sorted(by_n.items())]
    growth: Dict[str, Dict[str, Any]] = {}
    for control in points:
        rs = [r for r in rows if r["control"] == control]
        xs = [r["ranks"] for r in rs]
        surv = [r["survivor_bytes"] for r in rs]
        g = {
            "ranks": [xs[0], xs[-1]],
            "coordinator_exponent": exponent(xs, [r["coordinator_cpu_ms"] for r in rs]),
            "assign_exponent": exponent(xs, [r["assign_ms"] for r in rs]),
            "survivor_messages_exponent": exponent(xs, [r["survivor_messages"] for r in rs]) if None not in surv else None,
            "survivor_bytes_exponent": exponent(xs, surv) if None not in surv else None,
            "survivor_bytes_growth_pct": 100.0 * (surv[-1] / surv[0] - 1.0) if None not in surv and surv[0] else None,
        }
        g["survivor_flat"] = None if g["survivor_bytes_growth_pct"] is None else abs(g["survivor_bytes_growth_pct"]) <= TARGETS["survivor_bytes_growth_pct"]
        g["coordinator_at_most_linear"] = None if g["coordinator_exponent"] is None else g["coordinator_exponent"] <= TARGETS["coordinator_exponent"]
        growth[control] = g
    return {"rows": rows, "growth": growth, "targets": TARGETS}


def run(bench: Any, log: Callable[[str], None]) -> Dict[str, Any]:
    """Every world size of the plan with each control, ``b5_sim_reps`` times, alternated."""
    p = bench.plan
    points: Dict[str, Dict[int, List[Dict[str, Any]]]] = {c: {n: [] for n in p.b5_ranks} for c in p.b5_controls}
    for rep in range(p.b5_sim_reps):
        for n in p.b5_ranks:
            for control in p.b5_controls:
                t0 = time.monotonic()
                pt = bench.sim_point("b5", n, p.b5_steady_s, control, rep)
                points[control][n].append(pt)
                s = pt.get("survivor") or {}
                log(
                    f"  b5-{n}-{control}: {time.monotonic() - t0:.0f}s: coordinator {pt['recovery_cpu_net_ms']} ms CPU (gross {pt['recovery_cpu_ms']}), "
                    f"last assign {pt['assign_ms']} ms; survivor {s.get('messages')} messages, {s.get('bytes')} bytes"
                )
    return dict(summarize(points), steady_s=p.b5_steady_s, workers_per_node=p.b7_wpn)


def headline(b5: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """latest.json's B5 keys: the coordinator's exponent with relays and without, and the
    survivor's bytes growth (the larger of the two controls'); None where not measured."""
    g = (b5 or {}).get("growth", {})
    surv = [v["survivor_bytes_growth_pct"] for v in g.values() if v.get("survivor_bytes_growth_pct") is not None]
    return {
        "b5_coordinator_exponent": g.get("node", {}).get("coordinator_exponent"),
        "b5_coordinator_exponent_rank": g.get("rank", {}).get("coordinator_exponent"),
        "b5_survivor_bytes_growth_pct": max(surv, key=abs) if surv else None,
    }


def group_init_per_doubling_s(b5: Dict[str, Any]) -> float:
    """B6's growth of the re-formation per doubling of the world (``sim.Costs``): the simulated
    control plane's re-formed time, with relays where measured, from the smallest world to the
    largest (the gloo group's own connections are not in it). The earlier B5 of real workers
    (rows with ``workers``): its reconfigure from 2 to 8 workers."""
    rows = b5["rows"]
    if rows and "workers" in rows[0]:
        d = math.log2(rows[-1]["workers"] / rows[0]["workers"])
        return max(0.0, (rows[-1]["reconfigure_s"] - rows[0]["reconfigure_s"]) / d) if d > 0 else 0.0
    control = "node" if any(r["control"] == "node" for r in rows) else rows[0]["control"]
    rs = [r for r in rows if r["control"] == control]
    d = math.log2(rs[-1]["ranks"] / rs[0]["ranks"])
    return max(0.0, (rs[-1]["reformed_ms"] - rs[0]["reformed_ms"]) / 1000.0 / d) if d > 0 else 0.0


def one_line(b5: Dict[str, Any]) -> str:
    parts = []
    for control, g in b5["growth"].items():
        rs = [r for r in b5["rows"] if r["control"] == control]
        ce, se = g["coordinator_exponent"], g["survivor_bytes_growth_pct"]
        parts.append(
            f"control={control}: coordinator {rs[0]['coordinator_cpu_ms']:.0f} -> {rs[-1]['coordinator_cpu_ms']:.0f} ms CPU from {rs[0]['ranks']:,} to {rs[-1]['ranks']:,} ranks "
            f"(exponent {'n/a' if ce is None else f'{ce:.2f}'}); survivor {rs[0]['survivor_messages']} -> {rs[-1]['survivor_messages']} messages, "
            f"{rs[0]['survivor_bytes']} -> {rs[-1]['survivor_bytes']} bytes ({'n/a' if se is None else f'{se:+.1f} %'})"
        )
    return "; ".join(parts)
