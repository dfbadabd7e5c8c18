"""``python -m bench.moves_bench [--quick]``: planned moves (issue 33, "Measured"), side by side in one run.

1. The downtime of a planned move (a drain of rank 1's node, asked through the run directory as
   ``ckptless-hpc drain`` asks) against a failure recovery of the same rank (``fault=kill_worker``
   at ``fault.at=step``: after its backward, so that the step in flight is lost), the same model,
   2 nodes and a hot spare, ddp; back-to-back pairs, each run's phases (summary.json ``moves[0]``
   and ``recoveries[0]``) and the steps rank 0 reported twice (redone). Every run's final hash is
   checked against the fault-free run's (the oracle).
2. A straggler at x3 (``fault=slow`` on rank 1 from step 10 to the end): the job's wall time over
   its steps with ``cluster.straggler_action=report`` against ``replace`` (its node moved to the
   spare), and a fault-free run's.

Every run is a real job (``python -m ckptless_hpc``). Writes ``bench/results/only-moves.json``
(``--quick``: ``quick-moves.json``); run directories go to ``bench/results/tmp/moves``. Also the
section ``moves`` of ``python -m bench`` (the full run, and ``--only moves``, which writes the same
file); the quick smoke leaves it out (tests/bench/test_moves_bench.py runs ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # python bench/moves_bench.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, BenchError, JobRun, machine_info, median, prune_weights, read_jsonl, run_ckptless, task_overrides  # noqa: E402
from ckptless_hpc.rundir import requests  # noqa: E402

RESULTS = REPO / "bench" / "results"
PHASES = ("downtime_s", "detect_s", "reconfigure_s", "transfer_s", "resume_s")


def _drained(run_dir: Path, overrides: List[str], at_step: int, timeout_s: float = 900) -> JobRun:
    """A job whose node local1 is drained once rank 0 committed ``at_step`` (and the spare is built)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", "train.log_every=1000000", *overrides]
    t0 = time.monotonic()
    with open(run_dir / "stdout.log", "w", encoding="utf-8") as out:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        asked = False
        while p.poll() is None and time.monotonic() - t0 < timeout_s:
            if not asked:
                ev = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
                if any(e["event"] == "spare_ready" for e in ev) and any(e["event"] == "step" and e["step"] >= at_step for e in ev):
                    requests.write(str(run_dir / "requests"), "drain", node="local1", reason="bench")
                    asked = True
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
            raise BenchError(f"{run_dir}: ran past {timeout_s:.0f} s")
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    if p.returncode != 0 or len(summary.get("moves", [])) != 1:
        raise BenchError(f"{run_dir}: exit {p.returncode}, {len(summary.get('moves', []))} move(s) (want 1); see its stdout.log and events.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    prune_weights(run_dir)
    return JobRun(run_dir, summary, events, time.monotonic() - t0)


def _redone(run: JobRun) -> int:
    steps = [e["step"] for e in run.of("step")]
    return len(steps) - len(set(steps))


def measure(quick: bool, tmp: Path) -> Dict[str, Any]:
    t_start = time.monotonic()
    size, steps, reps, slow_steps = ("tiny", 600, 1, 200) if quick else ("default", 200, 3, 200)
    base = [*task_overrides(size), f"train.steps={steps}", "cluster.nodes=2", "cluster.spare_nodes=1", "train.threads=1"]
    clean = run_ckptless(tmp / "fault-free", base + ["fault=none"])
    sha = clean.summary["final_state_sha256"]
    pairs = []
    for i in range(reps):
        moved = _drained(tmp / f"drain{i}", base + ["fault=none"], steps // 3)
        killed = run_ckptless(tmp / f"kill{i}", base + ["fault=kill_worker", "fault.rank=1", f"fault.step={steps // 3}", "fault.at=step"])
        m, r = moved.summary["moves"][0], killed.summary["recoveries"][0]
        pairs.append({
            "move": {k: m[k] for k in PHASES} | {"planned_step": m["planned"]["step"], "redone": _redone(moved), "oracle": moved.summary["final_state_sha256"] == sha},
            "recovery": {k: r[k] for k in PHASES} | {"target_step": r["target_step"], "redone": _redone(killed), "oracle": killed.summary["final_state_sha256"] == sha},
        })
    slow = [f"train.steps={slow_steps}", "fault=slow", "fault.rank=1", "fault.step=10", f"fault.duration={slow_steps}", "fault.factor=3"]
    sbase = [o for o in base if not o.startswith("train.steps=")]
    walls: Dict[str, Any] = {}
    for action in () if quick else ("report", "replace"):  # the tiny model's steps are too short for the detector's window
        run = run_ckptless(tmp / f"straggler-{action}", sbase + slow + [f"cluster.straggler_action={action}"])
        times = [e["time"] for e in run.of("step")]
        walls[action] = {"train_s": times[-1] - times[0], "moves": len(run.summary["moves"]), "steps": len(times)}
    if not quick:
        healthy = run_ckptless(tmp / "straggler-none", sbase + [f"train.steps={slow_steps}", "fault=none"])
        ht = [e["time"] for e in healthy.of("step")]
        walls["healthy"] = {"train_s": ht[-1] - ht[0], "steps": len(ht)}
    down_move, down_rec = median(p["move"]["downtime_s"] for p in pairs), median(p["recovery"]["downtime_s"] for p in pairs)
    return {
        "size": size, "steps": steps, "reps": reps, "pairs": pairs,
        "move_downtime_s": down_move, "recovery_downtime_s": down_rec, "move_over_recovery": down_move / down_rec if down_rec else None,
        "moves_redone_steps": sum(p["move"]["redone"] for p in pairs), "recoveries_redone_steps": sum(p["recovery"]["redone"] for p in pairs),
        "oracle": all(p["move"]["oracle"] and p["recovery"]["oracle"] for p in pairs),
        "straggler": walls or None, "replace_speedup": walls["report"]["train_s"] / walls["replace"]["train_s"] if walls else None,
        "elapsed_s": time.monotonic() - t_start,
    }


def table(r: Dict[str, Any]) -> str:
    s = r["straggler"]
    lines: List[str] = [
        f"planned moves ({r['size']} model, {r['reps']} pair(s), ddp, 2 nodes + 1 spare)",
        f"  drain (planned move)     downtime median {r['move_downtime_s']:.3f} s; steps redone {r['moves_redone_steps']}",
        f"  kill_worker (recovery)   downtime median {r['recovery_downtime_s']:.3f} s; the step in flight at the kill lost (rank 0 never reported it)",
        f"  move / recovery          x{r['move_over_recovery']:.2f}; oracle {'held' if r['oracle'] else 'BROKEN'}",
    ]
    if s is None:
        return "\n".join(lines + ["  straggler: not in --quick"])
    lines += [
        f"  straggler x3, {s['report']['steps']} steps: report {s['report']['train_s']:.1f} s, replace {s['replace']['train_s']:.1f} s "
        f"({s['replace']['moves']} move), healthy {s['healthy']['train_s']:.1f} s: replace x{r['replace_speedup']:.2f} faster",
    ]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moves_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the smoke variant: the tiny model, one pair, fewer steps")
    ap.add_argument("--results", type=Path, default=RESULTS, help="results folder; run directories in DIR/tmp/moves")
    args = ap.parse_args(argv)
    results = args.results.resolve()
    res: Dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "command": "python -m bench.moves_bench" + (" --quick" if args.quick else ""),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    tmp = results / "tmp" / "moves"
    res["moves"] = measure(args.quick, tmp)
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path = results / ("quick-moves.json" if args.quick else "only-moves.json")
    path.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(tmp, ignore_errors=True)  # run directories hold final states: a disk fills
    print(table(res["moves"]))
    print(f"\nload average at start {res['machine']['loadavg_at_start']}, at end {res['machine']['loadavg_at_end']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
