"""Chaos soak: many randomised fault schedules, each checked against the oracle.

    python -m ckptless_hpc.chaos runs=20 seed=7 [steps=60 nodes=3 workers_per_node=1 task=mlp parallel=ddp out=chaos-runs elastic=0]
    python -m ckptless_hpc.chaos cluster=slurm runs=10 seed=1 [steps=1500 task=lm kinds=crash_node,preempt out=chaos-slurm]

``cluster=slurm`` submits real jobs to the project's Slurm mini-cluster (as root, from a source
checkout: tests/slurm_cluster/up.sh 4) and injects faults from outside: crashed nodes, a killed
slurmd, a cancelled step, the lost batch host, preemption signals (``ckptless_hpc/chaos/slurm.py``;
its defaults: ``task=lm steps=1500 nodes=2 out=chaos-slurm timeout_s=600 redraws=2``).

Each run injects 1-3 faults (kinds, ranks, steps and moments of the recovery protocol drawn at
random) into a real local job and must end with the final state's sha256 equal to the
fault-free run of the same config, with every planned fault fired: a fault that never fired
proves nothing, so a schedule some of whose faults did not fire (a moment that never came, say
a transfer the rank was never asked to serve) is re-drawn, up to ``redraws`` times, and
reported. Prints one line per schedule (fired/planned) and a verdict; exits 1 if any run lost
or corrupted state (a wrong hash, a failed or stopped job) or still had unfired faults, 2 on
bad arguments.

``elastic=1`` (ddp, zero): the job may shrink to one node (``cluster.min_nodes=1``, the fixed-order
reduction) and starts with no spare: a loss shrinks it, a refill grows it back (a loss that
finds the refill built is a promotion), and the oracle is the fault-free run of the same config.
At most ``nodes - 1`` losses are drawn, so that a schedule never leaves no node, and no
``kill_spare`` (there is rarely a spare to kill).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..rundir.summary import read as read_summary
from ..config import ELASTIC_MODES

#: The soak's own record in its ``out`` folder (beside one run directory per schedule).
CHAOS_FILE = "chaos.json"

DEFAULTS: Dict[str, Any] = {
    "runs": 10,
    "seed": 0,
    "steps": 60,
    "nodes": 3,
    "workers_per_node": 1,
    "task": "mlp",
    "parallel": "ddp",
    "out": "chaos-runs",
    "timeout_s": 300,
    "redraws": 3,
    "cluster": "local",
    "kinds": "",
    "elastic": 0,
}
SLURM_DEFAULTS: Dict[str, Any] = {"steps": 1500, "nodes": 2, "task": "lm", "out": "chaos-slurm", "timeout_s": 600, "redraws": 2}
PARALLEL = ("ddp", "zero", "fsdp", "hsdp")
KINDS = ("kill_worker", "kill_node", "hang", "slow", "kill_spare", "corrupt_transfer", "truncate_transfer")
ELASTIC_KINDS = tuple(k for k in KINDS if k != "kill_spare")


def parse_args(argv: Sequence[str]) -> Dict[str, Any]:
    opts = dict(DEFAULTS)
    given = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in DEFAULTS:
            raise ValueError(f"bad argument {arg!r}. HINT: use key=value with a key among {', '.join(f'{k} (default {v})' for k, v in DEFAULTS.items())}")
        try:
            given[key] = type(DEFAULTS[key])(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a {type(DEFAULTS[key]).__name__}. HINT: e.g. {key}={DEFAULTS[key]}") from None
    if given.get("cluster", "local") not in ("local", "slurm"):
        raise ValueError(f"cluster={given['cluster']!r}: unknown backend. HINT: cluster=local (default) or cluster=slurm")
    opts.update(SLURM_DEFAULTS if given.get("cluster") == "slurm" else {}, **given)
    if opts["cluster"] == "slurm":
        from . import slurm as slurm_chaos

        slurm_chaos.parse_kinds(opts["kinds"])
        if opts["nodes"] != 2 or opts["workers_per_node"] != 1:
            raise ValueError(
                f"cluster=slurm nodes={opts['nodes']} workers_per_node={opts['workers_per_node']}: the mini-cluster has 4 nodes, and a job takes "
                "2 worker nodes + 1 spare so that one more is left for a requeue that excludes a lost node. HINT: leave nodes and workers_per_node at 2 and 1"
            )
    elif opts["kinds"]:
        raise ValueError(f"kinds={opts['kinds']!r} is for cluster=slurm. HINT: the local soak draws every kind; drop kinds=, or add cluster=slurm")
    if opts["elastic"] and opts["parallel"] not in ELASTIC_MODES:
        raise ValueError(f"elastic=1 with parallel={opts['parallel']}: only {' and '.join(ELASTIC_MODES)} shrink. HINT: parallel=ddp or zero, or elastic=0")
    if opts["parallel"] not in PARALLEL:
        raise ValueError(f"parallel={opts['parallel']!r}: unknown mode. HINT: use one of {', '.join(PARALLEL)}")
    if opts["runs"] < 1 or opts["steps"] < 30 or opts["nodes"] < 2:
        raise ValueError(f"runs={opts['runs']}, steps={opts['steps']}, nodes={opts['nodes']}: need runs >= 1, steps >= 30, nodes >= 2. HINT: the defaults work")
    return opts


def random_schedule(
    rng: random.Random, steps: int, nodes: int, workers_per_node: int, two_at_once: bool = True, max_losses: Optional[int] = None, kinds: Sequence[str] = KINDS
) -> List[Dict[str, Any]]:
    """1-3 faults, survivable by construction: at most one loss at a time and never the last
    holder of the state, so every schedule must end with the fault-free hash (pure).
    ``two_at_once`` False (sharded state with one copy): no fault during another's recovery
    that could take a second holder of the same shard (a kill while serving, or when a
    recovery starts): owner and holder lost together is the documented last resort, not a soak.
    ``max_losses`` (a job that shrinks): at most that many faults that lose a worker; the
    others drawn become stragglers."""
    world = nodes * workers_per_node
    faults: List[Dict[str, Any]] = []
    slots = sorted(rng.sample(range(5, steps - 10, 5), k=rng.randint(1, 3)))
    for step in slots:
        kind = rng.choice(kinds)
        f: Dict[str, Any] = {"kind": kind, "step": step}
        if kind == "kill_node":
            f["node"] = rng.randrange(nodes)
        elif kind != "kill_spare":
            f["rank"] = rng.randrange(world)
        if kind in ("kill_worker", "hang") and rng.random() < 0.4:
            f["at"] = rng.choice(("update", "recovery", "send", "receive") if two_at_once else ("update", "receive"))
        if kind == "slow":
            f.update(factor=rng.choice((4, 6, 8)), duration=rng.randint(5, 15))
        faults.append(f)
    kills = [f for f in faults if f["kind"] in ("kill_worker", "kill_node", "hang") and f.get("at", "step") in ("step", "update")]
    if not kills:  # wire damage, dead spares and faults during a recovery need a recovery to happen
        faults.append({"kind": "kill_worker", "rank": rng.randrange(world), "step": max(slots) + 5})
    if max_losses is not None:
        losses = [f for f in faults if f["kind"] in LOSSES]
        for f in losses[max(1, max_losses) :]:
            f.clear()
            f.update(kind="slow", rank=rng.randrange(world), step=steps // 2, factor=4, duration=5)
    return faults


LOSSES = ("kill_worker", "kill_node", "hang")  # faults that lose a worker (and, on one node each, a node)


def _survives_two(opts: Dict[str, Any]) -> bool:
    """Whether the soak's layout survives two losses in one recovery (every copy placed on
    another node: ddp always; sharded modes with two copies or three replicas)."""
    from ..state.placement import layout_tolerance

    world = opts["nodes"] * opts["workers_per_node"]
    return layout_tolerance(opts["parallel"], world, opts["workers_per_node"], _factor(opts), _shard_size(opts)) >= 2 or opts["parallel"] == "ddp"


def _factor(opts: Dict[str, Any]) -> int:
    return min(2, opts["nodes"] - 1)


def _shard_size(opts: Dict[str, Any]) -> int:
    return max(1, opts["nodes"] * opts["workers_per_node"] // 2) if opts["nodes"] * opts["workers_per_node"] % 2 == 0 else 1


def schedule_override(faults: List[Dict[str, Any]]) -> str:
    items = ["{" + ",".join(f"{k}:{v}" for k, v in f.items()) + "}" for f in faults]
    return "fault.schedule=[" + ",".join(items) + "]"


def _run(run_dir: str, overrides: List[str], timeout_s: float) -> Tuple[int, Optional[Dict[str, Any]]]:
    cmd = [sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", *overrides]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = -1
    try:
        return rc, read_summary(run_dir)  # None: the job wrote none
    except (OSError, ValueError):  # unreadable or not JSON (RunDirError): no verdict but FAIL
        return rc, None


def run_verdict(planned: int, rc: int, summary: Optional[Dict[str, Any]], want: str) -> Tuple[str, bool, int]:
    """One run's verdict (pure): ``("ok" | "FAIL" | "UNFIRED", oracle held, faults fired)``. The
    oracle: exit 0 and the final sha256 equal to the fault-free run's. Fired: the planned faults
    (indices ``0..planned-1``) the run's summary lists in ``faults_fired``, as the coordinator
    recorded them from the workers' reports, never the plan itself."""
    oracle = rc == 0 and summary is not None and summary.get("final_state_sha256") == want
    fired = len(set((summary or {}).get("faults_fired") or ()) & set(range(planned)))
    return ("ok" if fired == planned else "UNFIRED") if oracle else "FAIL", oracle, fired


def _one(i: int, attempt: int, base: List[str], out: str, opts: Dict[str, Any], rng: random.Random, want: str) -> Dict[str, Any]:
    """Run one drawn schedule; its verdict: the oracle held, and how many planned faults fired."""
    spares, max_losses, kinds = (0, opts["nodes"] - 1, ELASTIC_KINDS) if opts["elastic"] else (2, None, KINDS)
    faults = random_schedule(rng, opts["steps"], opts["nodes"], opts["workers_per_node"], two_at_once=_survives_two(opts), max_losses=max_losses, kinds=kinds)
    t0 = time.monotonic()
    overrides = base + [f"cluster.spare_nodes={spares}", "fault=none", schedule_override(faults)]
    rc, s = _run(os.path.join(out, f"run{i:03d}" + (f"-redraw{attempt}" if attempt else "")), overrides, opts["timeout_s"])
    verdict, oracle, fired = run_verdict(len(faults), rc, s, want)
    downs = [r["downtime_s"] for r in (s or {}).get("recoveries", [])]
    desc = "; ".join(
        f"{f['kind']}" + (f" r{f['rank']}" if "rank" in f else "") + (f" n{f['node']}" if "node" in f else "") + f" @{f['step']}" + (f"/{f['at']}" if "at" in f else "")
        for f in faults
    )
    print(
        f"{i:>4}{'r' if attempt else ' '} {verdict:<7} {rc:>4} {fired:>2}/{len(faults):<2}  {len(downs)} ({', '.join(f'{d:.2f}' for d in downs)})".ljust(54) + f" {desc}",
        flush=True,
    )
    return {
        "run": i,
        "attempt": attempt,
        "ok": verdict == "ok",
        "oracle": oracle,
        "exit_code": rc,
        "faults": faults,
        "fired": fired,
        "planned": len(faults),
        "downtimes_s": downs,
        "wall_s": round(time.monotonic() - t0, 2),
        "status": (s or {}).get("status"),
        "spare_nodes": spares,
        "shrunk": len(((s or {}).get("degraded") or {}).get("spans") or ()),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        opts = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"ckptless_hpc.chaos: {e}", file=sys.stderr)
        return 2
    if opts["cluster"] == "slurm":
        return _main_slurm(opts)
    rng = random.Random(opts["seed"])
    kills = 3 * opts["nodes"]  # spare budget: every loss finds a spare (refills included)
    base = [
        f"task={opts['task']}",
        f"train.steps={opts['steps']}",
        f"cluster.nodes={opts['nodes']}",
        f"cluster.workers_per_node={opts['workers_per_node']}",
        f"cluster.max_refills={kills}",
        "cluster.heartbeat_interval_s=0.25",
        "cluster.heartbeat_timeout_s=1.5",
        f"parallel={opts['parallel']}",
    ]
    if opts["elastic"]:  # shrinks down to one node; the oracle: the fault-free run with the same reduction
        base.append("cluster.min_nodes=1")
    if opts["parallel"] in ("zero", "fsdp"):  # two copies where there are nodes for them: a loss during a recovery is survived too
        base.append(f"replication.factor={_factor(opts)}")
    if opts["parallel"] == "hsdp":
        base.append(f"parallel.shard_size={_shard_size(opts)}")
    out = os.path.abspath(opts["out"])
    os.makedirs(out, exist_ok=True)
    rc, ref = _run(os.path.join(out, "baseline"), base + ["cluster.spare_nodes=0", "fault=none"], opts["timeout_s"])
    if rc != 0 or not ref:
        print(f"the fault-free baseline failed (exit {rc}); see {out}/baseline", file=sys.stderr)
        return 1
    print(
        f"baseline sha256 {ref['final_state_sha256'][:16]}  ({opts['task']}, parallel={opts['parallel']}, {opts['steps']} steps, {opts['nodes']}x{opts['workers_per_node']} ranks)"
    )
    print(f"{'run':>5} {'verdict':<7} {'exit':>4} {'fired':>5}  {'recoveries (downtime s)':<28} faults")
    results, redrawn = [], []
    for i in range(opts["runs"]):
        for attempt in range(opts["redraws"] + 1):
            r = _one(i, attempt, base, out, opts, rng, ref["final_state_sha256"])
            if r["oracle"] is False or r["fired"] == r["planned"] or attempt == opts["redraws"]:
                break
            redrawn.append(r)
        results.append(r)
    failed = [r for r in results if not r["ok"]]
    with open(os.path.join(out, CHAOS_FILE), "w", encoding="utf-8") as f:
        json.dump({"options": opts, "baseline_sha256": ref["final_state_sha256"], "runs": results, "redrawn": redrawn}, f, indent=2)
    fired, planned = sum(r["fired"] for r in results), sum(r["planned"] for r in results)
    print(
        f"{len(results) - len(failed)}/{len(results)} schedules kept the oracle with every planned fault fired ({fired}/{planned} faults fired; "
        f"{len(redrawn)} schedule(s) re-drawn for unfired faults)" + (f"; FAILED: {[r['run'] for r in failed]}" if failed else "")
    )
    return 1 if failed else 0


def _main_slurm(opts: Dict[str, Any]) -> int:
    from . import slurm as slurm_chaos
    from ..slurm.minicluster import ClusterError

    base = [f"task={opts['task']}", f"train.steps={opts['steps']}", "cluster.nodes=2", "cluster.workers_per_node=1", f"parallel={opts['parallel']}"]
    out = os.path.abspath(opts["out"])
    os.makedirs(out, exist_ok=True)
    rc, ref = _run(os.path.join(out, "baseline"), base + ["fault=none"], opts["timeout_s"])  # the oracle: the same config, fault-free, local
    if rc != 0 or not ref:
        print(f"the fault-free baseline failed (exit {rc}); see {out}/baseline", file=sys.stderr)
        return 1
    print(f"baseline sha256 {ref['final_state_sha256'][:16]}  ({opts['task']}, parallel={opts['parallel']}, {opts['steps']} steps, 2 worker nodes + 1 spare on Slurm)", flush=True)
    try:
        return slurm_chaos.main(opts, base + ["cluster.spare_nodes=1"], ref["final_state_sha256"], say=lambda line: print(line, flush=True))
    except ClusterError as e:
        print(f"ckptless_hpc.chaos: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
