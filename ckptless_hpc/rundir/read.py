"""Reading a run directory: what a job left behind, folded into answers (pure where possible).

A run directory (``hydra.run.dir``) holds ``events.jsonl`` from the moment the coordinator
starts, ``summary.json`` once it ends, ``coordinator.log``, ``logs/<worker>.log`` and Hydra's
``.hydra/`` (the composed config and the overrides); paths.py names them, events.py and
summary.py read their files. :func:`load_run` does the file I/O; every other function here
takes the loaded events/summary (and the time, where it matters) and returns plain values, so
the report and the ``status``/``logs`` tools are tested without processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .events import Event, RunDirError, read_events, split_attempts
from .events import parse_events as parse_events  # re-exported: events.py owns it
from .numbering import initial_ranks, node_order
from .paths import RunPaths
from .summary import read as read_summary


#: How far before a detection a fault injection may lie and still be "the" failure
#: (mirrors the coordinator: heartbeat timeout plus two intervals).
_DEFAULT_FAULT_WINDOW_S = 4.0


@dataclass
class Run:
    """Everything a run directory holds that the tools read."""

    path: str
    events: List[Event]
    summary: Optional[Dict[str, Any]] = None
    config: Optional[Dict[str, Any]] = None
    overrides: List[str] = field(default_factory=list)

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.path)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path)) or self.path

    def of(self, kind: str) -> List[Event]:
        return [e for e in self.events if e.get("event") == kind]

    def first(self, kind: str) -> Optional[Event]:
        return next((e for e in self.events if e.get("event") == kind), None)

    @property
    def attempts(self) -> List[List[Event]]:
        """The events split per coordinator start (a requeued Slurm job appends a new attempt)."""
        return split_attempts(self.events)

    @property
    def current(self) -> List[Event]:
        """The events of the latest attempt: the one summary.json (if any) describes."""
        att = self.attempts
        return att[-1] if att else []

    @property
    def started(self) -> Dict[str, Any]:
        """The latest ``job_started`` event ({} before the coordinator started)."""
        return next((e for e in reversed(self.events) if e.get("event") == "job_started"), {})

    def log_path(self, worker: str) -> str:
        return self.paths.worker_log(worker)

    @property
    def coordinator_log(self) -> str:
        return self.paths.coordinator_log


# ------------------------------------------------------------------------------ loading
def load_run(path: str) -> Run:
    """Read a run directory; :class:`RunDirError` (with a HINT) when it is not one."""
    if not os.path.exists(path):
        raise RunDirError(f"run directory {path!r} does not exist. HINT: pass the job's hydra.run.dir (default outputs/DATE/TIME)")
    if not os.path.isdir(path):
        raise RunDirError(f"{path!r} is a file, not a run directory. HINT: pass the directory that holds events.jsonl")
    if not RunPaths(path).is_run_dir():
        children = run_dirs_below(path)
        hint = (
            f"it holds {len(children)} run directories (a sweep?): pass them, e.g. {children[0]!r}"
            if children
            else "a run directory holds events.jsonl from the moment the job starts; pass the job's hydra.run.dir"
        )
        raise RunDirError(f"{path!r} is not a run directory (no events.jsonl, summary.json or job.json). HINT: {hint}")
    run = Run(path, read_events(path), read_summary(path), _load_config(path), _load_overrides(path))
    if run.summary is not None and run.summary.get("status") == "requeued" and not any(e.get("event") == "job_finished" for e in run.current):
        run.summary = None  # written by an attempt before the requeue; the latest one is still going
    return run


def run_dirs_below(path: str) -> List[str]:
    """Immediate subdirectories of ``path`` that are run directories (a Hydra multirun), in order."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [os.path.join(path, n) for n in names if any(os.path.isfile(m) for m in RunPaths(os.path.join(path, n)).markers)]
    return sorted(found, key=lambda p: _natural_key(os.path.basename(p)))


def expand_paths(paths: Sequence[str]) -> List[str]:
    """Each path as given, or, for a sweep directory (Hydra ``-m``), the run directories in it."""
    out: List[str] = []
    for p in paths:
        is_run = RunPaths(p).is_run_dir()
        below = [] if is_run else run_dirs_below(p)
        out.extend(below or [p])
    return out


def _load_config(path: str) -> Optional[Dict[str, Any]]:
    cfg = RunPaths(path).hydra_config
    if not os.path.exists(cfg):
        return None
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(cfg), resolve=False)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - a broken config only costs the labels that use it
        return None


def _load_overrides(path: str) -> List[str]:
    p = RunPaths(path).hydra_overrides
    if not os.path.exists(p):
        return []
    from omegaconf import OmegaConf

    try:
        return [str(x) for x in OmegaConf.load(p)]
    except Exception:  # noqa: BLE001
        return []


def _natural_key(name: str) -> Tuple:
    return tuple(int(part) if part.isdigit() else part for part in _split_digits(name))


def _split_digits(s: str) -> List[str]:
    parts, cur = [], ""
    for ch in s:
        if cur and ch.isdigit() != cur[-1].isdigit():
            parts.append(cur)
            cur = ""
        cur += ch
    return parts + ([cur] if cur else [])


# ------------------------------------------------------------------------------ membership
def rank_history(events: Sequence[Event]) -> Dict[int, List[Tuple[int, str]]]:
    """rank -> [(first generation, worker), ...]: who held each rank, generation by generation.

    Generation 0's ranks follow the coordinator's rule (ranks numbered node by node over the
    nodes started as active); each ``spare_promoted`` event hands a rank to a spare.
    Uses a ``ranks`` field of ``generation_started`` when the coordinator writes one.
    """
    history: Dict[int, List[Tuple[int, str]]] = {}
    started = next((e for e in events if e.get("event") == "generation_started"), None)
    if started is None:
        return history
    if isinstance(started.get("ranks"), dict):
        first = {int(r): str(w) for r, w in started["ranks"].items()}
    else:
        active = [e for e in events if e.get("event") == "node_started" and e.get("role") == "active" and e.get("time", 0) <= started.get("time", 0)]
        nodes = sorted({e["node"]: int(e.get("workers", 1)) for e in active}.items(), key=lambda kv: node_order(kv[0]))
        first = initial_ranks([(n, [f"{n}.{j}" for j in range(k)]) for n, k in nodes])
    for r, w in first.items():
        history[r] = [(0, w)]
    for e in events:
        if e.get("event") == "spare_promoted" and e.get("rank") is not None:
            history.setdefault(int(e["rank"]), []).append((int(e.get("gen") or 0), str(e["worker"])))
    return history


def worker_pids(events: Sequence[Event]) -> Dict[str, int]:
    return {str(e["worker"]): int(e["pid"]) for e in events if e.get("event") == "worker_connected" and e.get("pid") is not None}


# ------------------------------------------------------------------------------ progress
@dataclass
class Progress:
    """Where a (possibly running) job stands, from its events alone."""

    phase: str  # starting | training | recovering | finished
    step: int
    steps_total: Optional[int]
    loss: Optional[float]
    gen: int
    world: Optional[int]
    workers_alive: int
    spares_ready: int
    recoveries: int
    failures: int
    last_event_age_s: Optional[float]
    finished: Optional[Event]


def progress(events: Sequence[Event], steps_total: Optional[int], now: float) -> Progress:
    """Fold the events into a :class:`Progress` (pure; ``now`` is the wall clock, epoch s)."""
    role: Dict[str, str] = {}
    step, loss, gen, world = 0, None, -1, None
    phase = "starting"
    recoveries = failures = 0
    finished = None
    for e in events:
        kind = e.get("event")
        g = e.get("gen")
        if isinstance(g, int):
            gen = max(gen, g)
        if kind == "job_started":
            world = e.get("world")
        elif kind in ("worker_ready", "spare_ready"):
            role[e["worker"]] = "active" if kind == "worker_ready" else "spare"
        elif kind == "spare_promoted":
            role[e["worker"]] = "active"
        elif kind == "failure_detected":
            role[e["worker"]] = "dead"
            failures += 1
        elif kind == "generation_started":
            phase = "training"
        elif kind == "generation_bumped":
            phase = "recovering"
        elif kind == "reformed":
            phase = "training"
            recoveries += 1
        elif kind == "step":
            step, loss = int(e["step"]), e.get("loss")
        elif kind == "job_finished":
            phase, finished = "finished", e
    for e in events:  # idle spares of an excluded node are stopped by the coordinator
        if e.get("event") == "node_excluded":
            for w, r in role.items():
                if r == "spare" and w.rpartition(".")[0] == e.get("node"):
                    role[w] = "dead"
    age = now - float(events[-1]["time"]) if events else None
    return Progress(
        phase,
        step,
        steps_total,
        loss,
        gen,
        world,
        sum(1 for r in role.values() if r == "active"),
        sum(1 for r in role.values() if r == "spare"),
        recoveries,
        failures,
        age,
        finished,
    )


# ------------------------------------------------------------------------------ recoveries
@dataclass
class RecoveryView:
    """One recovery, with absolute times (epoch s) for drawing and the numbers for the text."""

    index: int
    gen: int
    failed_ranks: List[int]
    failed_nodes: List[str]
    failed_workers: List[str]
    replacements: Dict[str, str]
    reasons: List[str]
    target_step: Optional[int]
    detect_s: float
    reconfigure_s: float
    transfer_s: float
    resume_s: float
    downtime_s: float
    bytes_transferred: int
    survivors_restarted: int
    t_fail: float
    fault: Optional[Event] = None  # the fault_injected event that caused it, if injected
    rolled_back: int = 0  # committed steps reported before the failure and redone after it
    redone_steps: List[int] = field(default_factory=list)  # step numbers trained twice

    @property
    def phases(self) -> List[Tuple[str, float, float]]:
        """[(phase, start epoch s, duration s)] in order: detect, reconfigure, transfer, resume."""
        out, t = [], self.t_fail
        for name in PHASES:
            d = float(getattr(self, f"{name}_s"))
            out.append((name, t, d))
            t += d
        return out

    @property
    def t_resumed(self) -> float:
        return self.t_fail + self.downtime_s

    def cause(self) -> str:
        if not self.failed_ranks and self.replacements:  # nothing failed, ranks handed out: a shrunk job grown back
            return "grown back: " + ", ".join(f"rank {k} -> {v}" for k, v in self.replacements.items())
        if self.fault is not None:
            return fault_text(self.fault) + " (injected)"
        return "; ".join(sorted(set(self.reasons))) or "failure"


def fault_text(f: Event) -> str:
    """'kill_worker of rank 1 at step 20' from a fault_injected event."""
    kind = f.get("kind")
    who = f"node {f.get('node')}" if kind == "kill_node" else "a waiting spare" if kind == "kill_spare" else f"rank {f.get('rank')}"
    at = f.get("at") or "step"
    return f"{kind} of {who} " + (f"at step {f.get('step')}" if at == "step" else f"during {at} (step {f.get('step')})")


@dataclass
class Incident:
    """Something worth a line that is not a recovery: a straggler, a spare lost, a bad transfer."""

    t: float
    t_end: Optional[float]
    kind: str  # straggler | spare_failed | transfer_error
    text: str


def incidents(events: Sequence[Event]) -> List[Incident]:
    out: List[Incident] = []
    open_slow: Dict[Any, Incident] = {}
    for e in events:
        kind, t = e.get("event"), float(e.get("time", 0.0))
        if kind == "straggler":
            inc = Incident(t, None, "straggler", f"rank {e.get('rank')} ({e.get('worker')}) {e.get('ratio')}x slower than the typical rank")
            open_slow[e.get("rank")] = inc
            out.append(inc)
        elif kind == "straggler_recovered" and e.get("rank") in open_slow:
            open_slow.pop(e.get("rank")).t_end = t
        elif kind == "failure_detected" and e.get("role") == "spare":
            out.append(Incident(t, None, "spare_failed", f"hot spare {e.get('worker')} on {e.get('node')} failed ({e.get('reason')}): its node is excluded"))
        elif kind == "transfer_error":
            out.append(Incident(t, None, "transfer_error", f"state transfer to {e.get('worker')} from {e.get('source')} failed and was retried: {e.get('error')}"))
    return out


PHASES = ("detect", "reconfigure", "transfer", "resume")


def recoveries(run: Run) -> List[RecoveryView]:
    """Every recovery of a run, all attempts, numbered from 1.

    The latest attempt's come from summary.json once the job ended (same numbers as the file),
    else from its events; earlier attempts (before a requeue) come from their events, by the
    coordinator's own arithmetic. Times are anchored on each recovery's ``reformed`` event, so
    the drawn phases line up with the summary's.
    """
    attempts = run.attempts or [[]]
    views: List[RecoveryView] = []
    for k, events in enumerate(attempts):
        recs = (run.summary or {}).get("recoveries") if k == len(attempts) - 1 else None
        part = _from_summary(events, recs) if recs is not None else _from_events(events)
        _add_lost_steps(events, part)
        views += part
    for i, v in enumerate(views):
        v.index = i + 1
    return views


def _from_summary(events: Sequence[Event], recs: List[Dict[str, Any]]) -> List[RecoveryView]:
    reformed = {e.get("gen"): e for e in events if e.get("event") == "reformed"}
    views = []
    for i, r in enumerate(recs):
        ev = reformed.get(r["gen"])
        if r.get("t_fail") is not None:  # the coordinator's own anchor
            t_fail = float(r["t_fail"])
        elif ev is not None:  # summaries written before the anchors were kept
            t_ready = float(ev["time"])
            t_fail = t_ready - r["transfer_s"] - r["reconfigure_s"] - r["detect_s"]
        else:  # no event to anchor on: use the failure detection of this recovery
            det = [e for e in events if e.get("event") == "failure_detected" and e.get("worker") in set(r["failed_workers"])]
            t_fail = (float(det[0]["time"]) if det else 0.0) - r["detect_s"]
        views.append(
            RecoveryView(
                i + 1,
                r["gen"],
                list(r["failed_ranks"]),
                list(r["failed_nodes"]),
                list(r["failed_workers"]),
                dict(r.get("replacements") or {}),
                list(r.get("reasons") or []),
                r.get("target_step"),
                r["detect_s"],
                r["reconfigure_s"],
                r["transfer_s"],
                r["resume_s"],
                r["downtime_s"],
                int(r.get("bytes_transferred") or 0),
                int(r.get("survivors_restarted") or 0),
                t_fail,
                fault=_fault_before(events, t_fail + r["detect_s"], t_fail),
            )
        )
    return views


def _from_events(events: Sequence[Event]) -> List[RecoveryView]:
    """Recoveries of a running job, by the coordinator's own arithmetic (metrics.Recovery)."""
    views: List[RecoveryView] = []
    pending: List[Event] = []
    resumed = [e for e in events if e.get("event") == "resumed"]
    for e in events:
        kind = e.get("event")
        if kind == "failure_detected" and e.get("role") == "active":
            pending.append(e)
        elif kind == "reformed" and pending:
            t_detect = float(pending[0]["time"])
            fault = _fault_before(events, t_detect, t_detect - _DEFAULT_FAULT_WINDOW_S)
            t_fail = float(fault["time"]) if fault else t_detect
            t_ready = float(e["time"])
            gen = int(e.get("gen") or 0)
            fetched = [x for x in events if x.get("event") == "state_transferred" and x.get("gen") == gen]
            transfer = max([float(x.get("seconds") or 0.0) for x in fetched], default=0.0)
            res = next((x for x in resumed if float(x["time"]) >= t_ready), None)
            t_res = float(res["time"]) if res else None
            ready = t_ready - t_detect
            views.append(
                RecoveryView(
                    len(views) + 1,
                    gen,
                    sorted({p["rank"] for p in pending if p.get("rank") is not None}),
                    sorted({p["node"] for p in pending}),
                    [p["worker"] for p in pending],
                    {str(k): v for k, v in (e.get("replacements") or {}).items()},
                    [p.get("reason", "") for p in pending],
                    e.get("step"),
                    round(t_detect - t_fail, 4),
                    round(max(ready - transfer, 0.0), 4),
                    round(transfer, 4),
                    round(t_res - t_ready, 4) if t_res else 0.0,
                    round(t_res - t_fail, 4) if t_res else 0.0,
                    int(e.get("bytes") or 0),
                    0,
                    t_fail,
                    fault=fault,
                )
            )
            pending = []
    return views


def _fault_before(events: Sequence[Event], t_detect: float, t_from: float) -> Optional[Event]:
    cands = [e for e in events if e.get("event") == "fault_injected" and t_from - 1e-3 <= float(e["time"]) <= t_detect + 1e-3]
    return cands[-1] if cands else None


def _add_lost_steps(events: Sequence[Event], views: List[RecoveryView]) -> None:
    """Per recovery: committed steps rolled back, and the step numbers trained twice.

    The steps reported before the failure are those of earlier generations (event arrival
    order between ranks is not reliable at the millisecond).
    """
    steps = [e for e in events if e.get("event") == "step" and isinstance(e.get("gen"), int)]
    for v in views:
        last = max([int(e["step"]) for e in steps if e["gen"] < v.gen], default=0)
        target = v.target_step if v.target_step is not None else last
        v.rolled_back = max(0, last - target)
        v.redone_steps = list(range(target + 1, max(last, target) + 2))  # rolled-back steps + the in-flight one


# ------------------------------------------------------------------------------ series
@dataclass
class Series:
    """Per-step series of rank 0's metrics: training time (s since generation 0 started)."""

    t0: float
    t: List[float]
    step: List[int]
    loss: List[float]
    step_s: List[float]
    attempt: List[int]  # which coordinator start (0, 1, ... after requeues) reported the step

    def segments(self) -> List["Series"]:
        """One Series per attempt, so that lines are never drawn across a requeue gap."""
        out: List[Series] = []
        for i, a in enumerate(self.attempt):
            if not out or self.attempt[i - 1] != a:
                out.append(Series(self.t0, [], [], [], [], []))
            seg = out[-1]
            seg.t.append(self.t[i]), seg.step.append(self.step[i]), seg.loss.append(self.loss[i])
            seg.step_s.append(self.step_s[i]), seg.attempt.append(a)
        return out


def step_series(events: Sequence[Event]) -> Series:
    start = next((e for e in events if e.get("event") == "generation_started"), None)
    steps: List[Event] = []
    attempt: List[int] = []
    for k, att in enumerate(split_attempts(events)):
        for e in att:
            if e.get("event") == "step":
                steps.append(e)
                attempt.append(k)
    t0 = float(start["time"]) if start else (float(steps[0]["time"]) if steps else float(events[0]["time"]) if events else 0.0)
    return Series(
        t0,
        [float(e["time"]) - t0 for e in steps],
        [int(e["step"]) for e in steps],
        [float(e["loss"]) for e in steps],
        [float(e.get("step_s") or 0.0) for e in steps],
        attempt,
    )


@dataclass
class Requeue:
    """A gap between two attempts: the job ended (requeued) and started again."""

    t_end: float  # epoch s: job_finished of the earlier attempt
    t_restart: float  # epoch s: generation_started of the next (or its job_started)
    step: Optional[int]  # the step the next attempt resumed from
    reason: str


def requeues(events: Sequence[Event]) -> List[Requeue]:
    atts = split_attempts(events)
    out = []
    for prev, nxt in zip(atts, atts[1:]):
        end = next((e for e in reversed(prev) if e.get("event") == "job_finished"), prev[-1])
        start = next((e for e in nxt if e.get("event") == "generation_started"), nxt[0])
        out.append(Requeue(float(end["time"]), float(start["time"]), start.get("step"), str(end.get("error") or end.get("status") or "ended")))
    return out


def evaluations(events: Sequence[Event]) -> Dict[int, Event]:
    """step -> the ``eval`` event of that step (a recovered generation that redoes one: the last)."""
    return {int(e["step"]): e for e in events if e.get("event") == "eval" and isinstance(e.get("metrics"), dict)}


def global_batch(run: Run) -> Optional[int]:
    """Samples per optimizer step (task.batch_size x train.grad_accum x world size) when the config says it."""
    cfg = run.config or {}
    bs = (cfg.get("task") or {}).get("batch_size")
    accum = (cfg.get("train") or {}).get("grad_accum", 1)
    if isinstance(bs, int) and isinstance(accum, int):
        bs *= accum
    c = cfg.get("cluster") or {}
    world = run.started.get("world")
    if world is None and isinstance(c.get("nodes"), int) and isinstance(c.get("workers_per_node"), int):
        world = c["nodes"] * c["workers_per_node"]
    if isinstance(bs, int) and isinstance(world, int):
        return bs * world
    return None


def degraded(events: Sequence[Event]) -> Optional[Dict[str, Any]]:
    """A job that shrank (``cluster.min_nodes``): when it trained with fewer processes than ranks,
    from its ``reformed`` events (metrics.Degraded's report; a span still open ends at the last
    event), or None when it never shrank."""
    from ..metrics import Degraded

    d = Degraded()
    for e in events:
        if e.get("event") in ("generation_started", "reformed") and e.get("world"):
            d.reformed(int(e["step"]), float(e["time"]), len(e.get("ranks") or {}), int(e["world"]))
    if not d.spans:
        return None
    last_step = max((int(e["step"]) for e in events if e.get("event") == "step" and e.get("step") is not None), default=0)
    return d.report(float(events[-1]["time"]), last_step)
