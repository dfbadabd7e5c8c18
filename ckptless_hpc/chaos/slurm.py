"""Chaos on real Slurm: random schedules of faults injected from outside a running job.

    python -m ckptless_hpc.chaos cluster=slurm runs=10 seed=1 [steps=1500 task=lm kinds=... out=chaos-slurm]

Kinds (what a cluster does to a job, each done to the mini-cluster as it would happen):

- ``crash_node``: a worker or the spare node crashes (``down.sh --crash-node``: slurmd, its
  stepds and tasks SIGKILLed in one instant);
- ``kill_slurmd``: the node's slurmd alone dies; its tasks live on, Slurm loses the node ~20 s
  later and ends the node's srun;
- ``cancel_step``: ``scancel JOB.STEP`` of one node's step;
- ``lost_batch_host``: the node running the coordinator (the batch step, and rank 0) crashes;
- ``preempt``: ``scancel --signal=USR2 --batch JOB``, Slurm's warning before a preemption or a
  time limit: one emergency copy, requeue, resume.

The drawing is pure (``random_schedule``); the rest carries a schedule out against a live job
(``run_schedule``) and judges it from what the job wrote (``fired``): a fault counts as fired
only when the job shows its effect (the failure detected on that node, the requeued attempt
started), and a schedule passes only with every fault fired and the final state's sha256 equal
to the fault-free local run of the same config.

Why at most one node is lost per schedule: the job takes 3 of the cluster's 4 nodes (2 worker
nodes and a hot spare), a requeued job is given ``ExcNodeList`` = the nodes it lost, and it
needs 3 nodes outside that list, so a job that has lost two nodes and then requeues pends
forever on this cluster (docs/slurm.md). Preemptions exclude nothing: up to two per schedule.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..rundir.events import split_attempts
from ..slurm import commands, minicluster, watch
from .local import CHAOS_FILE

LOSSES = ("crash_node", "kill_slurmd", "cancel_step", "lost_batch_host")
KINDS = LOSSES + ("preempt",)
CLUSTER_NODES = ("n1", "n2", "n3", "n4")
KILL_SLURMD_BY_STEP = 150  # Slurm takes ~26 s to end the srun of a node whose slurmd died: early, so the job still runs then
EFFECT_WITHIN_S = {"kill_slurmd": 90.0, "lost_batch_host": 180.0, "preempt": 180.0}
EFFECT_DEFAULT_S = 60.0

Fault = Dict[str, Any]


def parse_kinds(value: str) -> List[str]:
    kinds = [k for k in value.split(",") if k] or list(KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"kinds={value!r}: unknown kind(s) {bad}. HINT: a comma-separated list among {', '.join(KINDS)}")
    return kinds


def random_schedule(rng: random.Random, steps: int, kinds: Sequence[str]) -> List[Fault]:
    """1-3 faults in step order: at most one node loss (see the module doc), 0-2 preemptions.
    A loss targets a worker node other than the batch host, or the spare node; a killed
    slurmd comes before step ``KILL_SLURMD_BY_STEP`` (pure)."""
    losses = [k for k in kinds if k in LOSSES]
    preempts = rng.randint(0, 2) if "preempt" in kinds else 0
    loss = bool(losses) and (preempts == 0 or rng.random() < 0.8)
    if not loss and not preempts:
        preempts = 1
    faults: List[Fault] = []
    if loss:
        kind = rng.choice(losses)
        f: Fault = {"kind": kind}
        if kind != "lost_batch_host":
            f["target"] = rng.choice(("worker", "worker", "spare"))
        faults.append(f)
    faults += [{"kind": "preempt"} for _ in range(preempts)]
    rng.shuffle(faults)
    hi = max(60, steps * 3 // 4)
    slots = sorted(rng.sample(range(30, hi, 10), k=len(faults)))
    for f, step in zip(faults, slots):
        f["step"] = step
    slurmd = next((f for f in faults if f["kind"] == "kill_slurmd"), None)
    if slurmd is not None and slurmd["step"] > KILL_SLURMD_BY_STEP:
        slurmd["step"] = rng.randrange(30, KILL_SLURMD_BY_STEP + 1, 10)
        faults.sort(key=lambda f: f["step"])
    return faults


def describe(faults: Sequence[Fault]) -> str:
    return "; ".join(f"{f['kind']}" + (f" {f['target']}" if "target" in f else "") + f" @{f['step']}" for f in faults)


# ------------------------------------------------------------------ reading the job's state
def _current(evs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return split_attempts(evs)[-1] if evs else []


def _step(evs: Sequence[Dict[str, Any]]) -> int:
    return max((int(e["step"]) for e in _current(evs) if e.get("event") == "step"), default=-1)


def _live_spare(evs: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The current attempt's hot spare node that is neither promoted nor failed."""
    cur = _current(evs)
    gone = {e.get("node") for e in cur if e.get("event") in ("failure_detected", "spare_promoted", "node_excluded")}
    return next((e["node"] for e in cur if e.get("event") == "node_started" and e.get("role") == "spare" and e["node"] not in gone), None)


def _slurm_step(evs: Sequence[Dict[str, Any]], node: str) -> Optional[int]:
    hello = [e for e in _current(evs) if e.get("event") == "worker_connected" and e.get("node") == node and e.get("slurm_step") is not None]
    return int(hello[-1]["slurm_step"]) if hello else None


def resolve(fault: Fault, evs: Sequence[Dict[str, Any]], batch_host: str) -> Optional[str]:
    """The node a fault hits now (None: no such node at this moment, e.g. the spare was used)."""
    if fault["kind"] == "preempt":
        return batch_host
    if fault["kind"] == "lost_batch_host":
        return batch_host
    if fault.get("target") == "spare":
        return _live_spare(evs)
    workers = sorted({w.rpartition(".")[0] for w in watch.current_ranks(evs).values()} - {batch_host})
    return workers[0] if workers else None


def fired(fault: Fault, injected: Dict[str, Any], evs: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The event that shows this injected fault took effect, or None (pure)."""
    t, attempts = injected["time"], injected["attempts"]
    after = [e for e in evs if float(e.get("time", 0)) >= t]
    if fault["kind"] in ("crash_node", "kill_slurmd", "cancel_step"):
        return next((e for e in after if e.get("event") == "failure_detected" and e.get("node") == injected["node"]), None)
    started = split_attempts(evs)[attempts:] if evs else []
    restart = next((e for att in started for e in att if e.get("event") == "generation_started"), None)
    if fault["kind"] == "lost_batch_host":
        return restart if restart and not any(w.startswith(injected["node"] + ".") for w in restart["ranks"].values()) else None
    saved = next((e for e in after if e.get("event") == "emergency_save" and "warning signal" in str(e.get("reason")) and e.get("saved")), None)
    return restart if saved and restart else None


# ------------------------------------------------------------------ acting on the cluster
def inject(fault: Fault, job_id: str, node: str, evs: Sequence[Dict[str, Any]]) -> str:
    kind = fault["kind"]
    if kind in ("crash_node", "lost_batch_host"):
        minicluster.crash_node(node)
        return f"crashed {node}"
    if kind == "kill_slurmd":
        minicluster.kill_slurmd(node)
        return f"killed slurmd of {node}"
    if kind == "cancel_step":
        step = _slurm_step(evs, node)
        if step is None:
            raise RuntimeError(
                f"job {job_id}: cancel_step on node {node}, but no worker_connected event of the current attempt names a Slurm step on it (its worker has not connected yet, or the node holds none of the job's steps); the injection is reported as not fired"
            )
        commands.cancel_step(job_id, step)
        return f"scancel {job_id}.{step} ({node})"
    commands.run(["scancel", "--signal=USR2", "--batch", job_id])
    return f"USR2 to the batch step on {node}"


def run_schedule(run_dir: Path, job_id: str, faults: Sequence[Fault], deadline: float, say: Callable[[str], None]) -> List[Dict[str, Any]]:
    """Inject each fault in turn (when the job's current attempt has passed the fault's step),
    wait for its effect, then go on; one record per fault (``evidence`` None: did not fire)."""
    records: List[Dict[str, Any]] = []
    for f in faults:
        rec: Dict[str, Any] = {"fault": f, "node": None, "action": None, "evidence": None}
        records.append(rec)

        def due() -> Optional[List[Dict[str, Any]]]:
            evs = watch.events(run_dir)
            return evs if _step(evs) >= f["step"] or not watch.in_queue(job_id) else None  # noqa: B023 - called by wait_for in this iteration only

        try:
            evs = watch.wait_for(f"step {f['step']}", due, max(1.0, deadline - time.monotonic()), poll_s=0.2)
        except watch.WaitTimeout:
            return records
        if not watch.in_queue(job_id):
            say(f"    {f['kind']} @{f['step']}: the job ended first")
            return records
        host = watch.batch_host(job_id)
        node = resolve(f, evs, host)
        if node is None:
            say(f"    {f['kind']} @{f['step']}: no {f.get('target', 'node')} to hit")
            continue
        injected = {"time": time.time(), "attempts": len(split_attempts(evs)), "node": node, "step": _step(evs)}
        rec.update(node=node, at_step=injected["step"], time=injected["time"])
        try:
            rec["action"] = inject(f, job_id, node, evs)
        except (commands.SlurmCommandError, minicluster.ClusterError, RuntimeError) as e:  # not fired: reported, the schedule goes on
            rec["action"] = f"{f['kind']} on {node} failed: {str(e).splitlines()[0]}"
            say(f"    {rec['action']}")
            continue
        within = min(EFFECT_WITHIN_S.get(f["kind"], EFFECT_DEFAULT_S), max(1.0, deadline - time.monotonic()))
        try:
            rec["evidence"] = watch.wait_for(f"the effect of {f['kind']}", lambda: fired(f, injected, watch.events(run_dir)), within, poll_s=0.2)  # noqa: B023 - polled in this iteration only
        except watch.WaitTimeout:
            pass
        ev = rec["evidence"]
        say(f"    {rec['action']} at step {rec['at_step']}: " + (f"{ev['event']} after {float(ev['time']) - injected['time']:.1f} s" if ev else "NO EFFECT"))
    return records


def outcome(evs: Sequence[Dict[str, Any]], summary: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What the job did, from its events and its final summary (pure)."""
    atts = split_attempts(evs) if evs else []
    return {
        "status": (summary or {}).get("status"),
        "exit_code": (summary or {}).get("exit_code"),
        "requeues": max(0, len(atts) - 1),
        "recoveries": sum(1 for e in evs if e.get("event") == "reformed"),
        "final_state_sha256": (summary or {}).get("final_state_sha256"),
        "ended_attempts": [next((e.get("status") for e in att if e.get("event") == "job_finished"), "no summary (coordinator lost)") for att in atts],
    }


def one(index: int, attempt: int, faults: List[Fault], base: List[str], out: Path, want: str, timeout_s: float, say: Callable[[str], None]) -> Dict[str, Any]:
    """Submit one job, carry its schedule out, wait for its end, judge it; the cluster is
    restored (nodes idle) before this returns."""
    run_dir = out / (f"run{index:03d}" + (f"-redraw{attempt}" if attempt else ""))
    t0 = time.monotonic()
    job_id = watch.submit(run_dir, *base)
    say(f"{index:>4}{'r' if attempt else ' '} job {job_id}: {describe(faults)}")
    records: List[Dict[str, Any]] = []
    summary = None
    try:
        records = run_schedule(run_dir, job_id, faults, t0 + timeout_s, say)
        summary = watch.finished(job_id, run_dir, within_s=max(1.0, t0 + timeout_s - time.monotonic()))
    except (watch.WaitTimeout, FileNotFoundError, ValueError) as e:
        say(f"    the job did not end cleanly: {str(e).splitlines()[0]}")
    finally:
        if watch.in_queue(job_id):
            commands.cancel_job(job_id)
            watch.wait_for(f"job {job_id} to go", lambda: not watch.in_queue(job_id), 60, poll_s=0.5)
        minicluster.restore(list(CLUSTER_NODES))
    res = outcome(watch.events(run_dir), summary)
    n_fired = sum(1 for r in records if r["evidence"])
    oracle = res["status"] == "completed" and res["final_state_sha256"] == want
    verdict = "ok" if oracle and n_fired == len(faults) else ("FAIL" if not oracle else "UNFIRED")
    say(
        f"{index:>4}{'r' if attempt else ' '} {verdict:<7} fired {n_fired}/{len(faults)}  {res['status']} (exit {res['exit_code']}), "
        f"{res['requeues']} requeue(s), {res['recoveries']} recovery(ies), attempts {res['ended_attempts']}, oracle {'yes' if oracle else 'NO'}  [{time.monotonic() - t0:.0f} s]"
    )
    return {
        "run": index,
        "attempt": attempt,
        "job": job_id,
        "run_dir": str(run_dir),
        "ok": verdict == "ok",
        "verdict": verdict,
        "oracle": oracle,
        "faults": faults,
        "fired": n_fired,
        "planned": len(faults),
        "injections": [{k: v for k, v in r.items() if k != "evidence"} | {"evidence": (r["evidence"] or {}).get("event")} for r in records],
        "wall_s": round(time.monotonic() - t0, 1),
        **res,
    }


def main(opts: Dict[str, Any], base: List[str], want: str, say: Callable[[str], None] = print) -> int:
    """Run ``opts['runs']`` schedules (re-drawing unfired ones); write chaos.json; 0 if all passed."""
    env = minicluster.ensure_cluster(len(CLUSTER_NODES))
    os.environ.update(env)
    minicluster.restore(list(CLUSTER_NODES))
    kinds = parse_kinds(opts["kinds"])
    rng = random.Random(opts["seed"])
    out = Path(opts["out"]).resolve()
    slurm_base = base + ["fault=none"]
    results, redrawn = [], []
    for i in range(opts["runs"]):
        for attempt in range(opts["redraws"] + 1):
            r = one(i, attempt, random_schedule(rng, opts["steps"], kinds), slurm_base, out, want, opts["timeout_s"], say)
            if not r["oracle"] or r["fired"] == r["planned"] or attempt == opts["redraws"]:
                break
            redrawn.append(r)
        results.append(r)
    failed = [r for r in results if not r["ok"]]
    with open(out / CHAOS_FILE, "w", encoding="utf-8") as f:
        json.dump({"options": opts, "baseline_sha256": want, "runs": results, "redrawn": redrawn}, f, indent=2)
    n_fired, planned = sum(r["fired"] for r in results), sum(r["planned"] for r in results)
    say(
        f"{len(results) - len(failed)}/{len(results)} Slurm schedules kept the oracle with every planned fault fired ({n_fired}/{planned} faults fired; "
        f"{len(redrawn)} schedule(s) re-drawn for unfired faults)" + (f"; FAILED: {[r['run'] for r in failed]}" if failed else "")
    )
    return 1 if failed else 0
