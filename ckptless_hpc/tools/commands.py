"""``ckptless-hpc report|status|logs|cancel|drain``: look at a run directory and act on its job.

``cli.entry`` dispatches here. Decisions are pure functions of what the run directory holds
(:mod:`ckptless_hpc.rundir`) plus what a probe says about processes or Slurm jobs; the probes
(``/proc`` and signals for local runs, one batched squeue call for Slurm runs) are the only
places that touch the system.

Exit codes: 0 done; 1 the action failed (a job that would not stop); 2 bad input (not a run
directory, unknown rank, bad arguments), with a message that names the value and gives a HINT.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, TextIO, Tuple

from ..rundir import requests
from ..rundir.paths import MODEL, RunPaths
from ..rundir.read import Progress, Run, RunDirError, expand_paths, load_run, progress, rank_history, worker_pids

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
PROG = "ckptless-hpc"
FOLLOW_POLL_S = 0.5  # --follow reads the files this often (never a tight loop)


class UsageError(ValueError):
    """Bad input from the user: the message names the value and ends with a HINT."""


# ============================================================================== probes (I/O)
class LocalProcs:
    """What this machine says about a PID (Linux /proc, signals). Injected for tests."""

    def alive(self, pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # a zombie is dead
        except OSError:
            return True

    def cmdline(self, pid: int) -> Optional[str]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return None

    def ppid(self, pid: int) -> Optional[int]:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                return int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return None

    def signal(self, pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False


class SlurmQueue:
    """Slurm job states, all jobs in ONE squeue call (never one call per job, never a tight loop)."""

    def states(self, job_ids: Sequence[str]) -> Dict[str, str]:
        """job id -> state (PENDING, RUNNING, ...) for the jobs squeue still lists."""
        from ..slurm import commands

        return commands.job_states([_check_job_id(j) for j in job_ids])

    def cancel(self, job_id: str) -> None:
        from ..slurm import commands

        commands.cancel_job(_check_job_id(job_id))


def _check_job_id(job_id: str) -> str:
    if not re.fullmatch(r"[0-9]+", str(job_id)):
        raise UsageError(f"Slurm job id {job_id!r} is not a number. HINT: the run directory's job.json or events name it")
    return str(job_id)


# ============================================================================== decisions (pure)
def slurm_job_id(run: Run) -> Optional[str]:
    """The Slurm job id of a run, wherever the launcher recorded it (None for local runs)."""
    s = run.summary or {}
    e = run.started
    meta = _job_json(run.path)
    for src in (s, e, meta):
        v = src.get("slurm_job_id")
        if v:
            return str(v)
    if meta.get("job_id"):  # written by `submit` for cluster=slurm
        return str(meta["job_id"])
    job = e.get("job") or s.get("job")  # a coordinator inside Slurm names its job by the Slurm id
    return str(job) if job and str(job).isdigit() else None


def _job_json(path: str) -> Dict:
    import json

    p = RunPaths(path).job
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@dataclass
class Coordinator:
    pid: Optional[int]
    alive: Optional[bool]  # None: cannot be told from this machine
    how: str


def find_coordinator(run: Run, procs: LocalProcs, hostname: str) -> Coordinator:
    """The local run's coordinator process, verified so that a reused PID is never taken for it.

    Prefers the ``coordinator_pid`` (and ``host``, when recorded) of the ``job_started`` event;
    else the parent of a live worker of this job (a worker's command line names its
    coordinator's address). A PID whose command line does not mention ckptless is not taken.
    """
    started = run.started
    host = started.get("host")
    if host and host != hostname:
        return Coordinator(started.get("pid"), None, f"runs on host {host}, not here ({hostname})")
    pid = started.get("coordinator_pid", started.get("pid"))
    if isinstance(pid, int):
        alive = procs.alive(pid) and _looks_like_coordinator(procs.cmdline(pid))
        return Coordinator(pid, alive, "pid recorded in events.jsonl")
    address = started.get("address")
    for worker, wpid in sorted(worker_pids(run.current).items()):
        if _is_job_worker(procs, wpid, address):
            parent = procs.ppid(wpid)
            if parent and procs.alive(parent) and _looks_like_coordinator(procs.cmdline(parent)):
                return Coordinator(parent, True, f"parent of live worker {worker} (pid {wpid})")
    return Coordinator(None, False, "no live process of this job found on this machine")


def _looks_like_coordinator(cmd: Optional[str]) -> bool:
    return cmd is None or "ckptless" in cmd


def _is_job_worker(procs: LocalProcs, pid: int, address: Optional[str]) -> bool:
    if not procs.alive(pid):
        return False
    cmd = procs.cmdline(pid) or ""
    return "ckptless_hpc.worker" in cmd and (address is None or address in cmd)


def live_workers(run: Run, procs: LocalProcs) -> Dict[str, int]:
    address = run.started.get("address")
    return {w: p for w, p in worker_pids(run.current).items() if _is_job_worker(procs, p, address)}


def classify(run: Run, prog: Progress, coord: Optional[Coordinator], slurm_state: Optional[str]) -> Tuple[str, str]:
    """(state, why) of a run: completed | failed | no_spare | state_lost | startup_failed | running |
    starting | recovering | pending | ended (no summary) | unknown."""
    s = run.summary
    if s is not None and s.get("status") != "requeued":
        return s["status"], f"summary.json says {s['status']} (exit {s['exit_code']})"
    if s is None and prog.finished is not None:
        return str(prog.finished.get("status")), "job_finished event (summary.json not written yet)"
    if slurm_state is not None:
        if slurm_state == "PENDING":
            return "pending", "Slurm: PENDING" + (" (requeued: resumes from the emergency copy)" if s is not None else "")
        if slurm_state in ("RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "SUSPENDED"):
            return _live_phase(prog), f"Slurm: {slurm_state}"
        return "ended", f"Slurm: {slurm_state}, and the job left no summary.json"
    if coord is not None and coord.alive:
        return _live_phase(prog), f"coordinator pid {coord.pid} is alive ({coord.how})"
    if coord is not None and coord.alive is None:
        return "unknown", coord.how
    return "ended", "no summary.json and no live coordinator: the job was killed or cancelled, or its machine went down"


def _live_phase(prog: Progress) -> str:
    return {"training": "running", "starting": "starting", "recovering": "recovering"}.get(prog.phase, "running")


def log_sources(run: Run, rank: Optional[int], worker: Optional[str], gen: Optional[int], waiting: bool = False) -> List[Tuple[str, str]]:
    """[(label, path)] of the logs to show: the coordinator's, then the chosen worker(s)' logs.

    Default: every worker that held rank 0. ``rank``: every worker that held that rank (a
    replacement took it over at a later generation), or only the one of generation ``gen``.
    """
    hist = rank_history(run.current)
    srcs = [("coord", run.coordinator_log)]
    if worker is not None:
        known = sorted(worker_pids(run.events)) or sorted({w for h in hist.values() for _, w in h})
        if worker not in known and not os.path.exists(run.log_path(worker)):
            raise UsageError(f"worker {worker!r} is not part of run {run.path} (its workers: {', '.join(known) or 'none yet'}). HINT: pass one of those, or --rank R")
        return srcs + [(worker, run.log_path(worker))]
    r = 0 if rank is None else rank
    if not hist and waiting:  # --follow of a job still starting: the coordinator's log until ranks exist
        return srcs
    if not hist:
        raise UsageError(f"run {run.path} has not assigned ranks yet (no generation started). HINT: wait for the start, or pass --worker NODE.I (logs/ lists them)")
    if r not in hist:
        raise UsageError(f"--rank {r}: no such rank in run {run.path} (world size {len(hist)}: ranks 0..{len(hist) - 1}). HINT: pass --rank 0..{len(hist) - 1}")
    holders = hist[r]
    if gen is not None:
        chosen = [w for g, w in holders if g <= gen][-1:]
        if not chosen:
            raise UsageError(f"--gen {gen}: run {run.path} has generations 0..{max(g for h in hist.values() for g, _ in h)}. HINT: pass one of those")
        holders = [(gen, chosen[0])]
    return srcs + [(f"rank{r} {w}", run.log_path(w)) for _, w in holders]


_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def merge_logs(texts: Sequence[Tuple[str, str]]) -> List[str]:
    """Lines of several logs, labelled and merged by their leading timestamps (stable).

    A line without a timestamp (a traceback) stays with the line above it.
    """
    entries: List[Tuple[str, int, int, str]] = []
    for k, (label, text) in enumerate(texts):
        last_ts = ""
        for i, line in enumerate(text.splitlines()):
            m = _TS.match(line)
            if m:
                last_ts = m.group(1)
            entries.append((last_ts, k, i, f"{label:<16}| {line}"))
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    return [e[3] for e in entries]


# ============================================================================== commands
def cmd_report(args: argparse.Namespace, out: TextIO) -> int:
    from . import report

    runs = _load_all(expand_paths(args.run_dirs))
    now = time.time()
    if len(runs) == 1:
        print(report.run_text(runs[0], now), file=out)
        target = args.out or runs[0].paths.report
        draw: Callable[[], str] = lambda: report.run_chart(runs[0], target)
    else:
        print(report.sweep_text(runs), file=out)
        target = args.out or RunPaths(_common_dir([r.path for r in runs])).report
        draw = lambda: report.sweep_chart(runs, target)
    if args.no_chart:
        return EXIT_OK
    try:
        path = draw()
    except report.ChartUnavailable as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write the chart to {target!r}: {e.strerror}. HINT: pass --out PATH.png somewhere writable") from None
    print(f"\nchart: {path}", file=out)
    return EXIT_OK


def _common_dir(paths: Sequence[str]) -> str:
    common = os.path.commonpath([os.path.abspath(p) for p in paths])
    if common in ("/", "") or not os.access(common, os.W_OK):
        return os.getcwd()
    return common


def cmd_status(args: argparse.Namespace, out: TextIO, procs: LocalProcs, queue: SlurmQueue) -> int:
    runs = _load_all(expand_paths(args.run_dirs))
    now = time.time()
    ids = {r.path: slurm_job_id(r) for r in runs}
    ask = sorted({j for r in runs for j in [ids[r.path]] if j and _unfinished(r)})
    states: Dict[str, str] = {}
    slurm_error = None
    if ask:
        try:
            states = queue.states(ask)
        except Exception as e:  # noqa: BLE001 - Slurm trouble is reported, not fatal to the other runs
            slurm_error = str(e)
    for run in runs:
        total = (run.config or {}).get("train", {}).get("steps") or (run.summary or {}).get("steps_requested")
        prog = progress(run.current, total, now)
        job = ids[run.path]
        coord = None if job else find_coordinator(run, procs, socket.gethostname())
        sstate = None
        if job and _unfinished(run) and slurm_error is None:
            sstate = states.get(job, "NOT_QUEUED")
        state, why = classify(run, prog, coord, sstate)
        print(status_text(run, prog, state, why, job, coord, slurm_error), file=out)
    return EXIT_OK


def _unfinished(run: Run) -> bool:
    return run.summary is None or run.summary.get("status") == "requeued"


def status_text(run: Run, prog: Progress, state: str, why: str, job: Optional[str], coord: Optional["Coordinator"], slurm_error: Optional[str]) -> str:
    s = run.summary
    started = run.started
    name = started.get("job") or (s or {}).get("job") or job or "?"
    head = f"{run.path}: {state.upper()}   job {name}" + (f" (Slurm job {job})" if job and job != name else " (Slurm)" if job else "")
    if len(run.attempts) > 1:
        head += f"   attempt {len(run.attempts)} (requeued {len(run.attempts) - 1}x)"
    lines = [head, f"  why         {why}"]
    if s is not None:
        lines.append(f"  steps       {s['steps_completed']}/{s['steps_requested']}   final loss {_f4(s.get('final_loss'))}   goodput {100 * s['goodput']:.2f}%")
        lines.append(f"  recoveries  {len(s['recoveries'])}   downtime {sum(r['downtime_s'] for r in s['recoveries']):.4f} s   wall {s['wall_s']:.2f} s")
        if s.get("error"):
            lines.append("  error       " + str(s["error"]).splitlines()[0])
    else:
        total = prog.steps_total if prog.steps_total is not None else "?"
        lines.append(f"  step        {prog.step}/{total}   loss {_f4(prog.loss)}   generation {prog.gen}")
        lines.append(f"  workers     {prog.workers_alive} training, {prog.spares_ready} hot spare(s) ready; {prog.failures} failure(s), {prog.recoveries} recovery(ies)")
        if prog.last_event_age_s is not None:
            lines.append(f"  last event  {prog.last_event_age_s:.1f} s ago")
    if slurm_error:
        lines.append(f"  slurm       could not ask Slurm: {slurm_error}")
    lines.append(f"  logs        {PROG} logs {run.path}   (report: {PROG} report {run.path})")
    return "\n".join(lines)


def _f4(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def cmd_logs(args: argparse.Namespace, out: TextIO, procs: LocalProcs) -> int:
    run = _load_all([args.run_dir])[0]
    srcs = log_sources(run, args.rank, args.worker, args.gen, waiting=args.follow)
    texts = [(label, _read(path)) for label, path in srcs]
    lines = merge_logs(texts)
    if args.tail is not None:
        lines = lines[-args.tail :] if args.tail > 0 else []
    for line in lines:
        print(line, file=out)
    missing = [p for _, p in srcs if not os.path.exists(p)]
    if missing and not args.follow:
        print(f"(no file yet: {', '.join(missing)})", file=out)
    if not args.follow:
        return EXIT_OK
    return _follow(run.path, args, {p: len(t.encode()) for (_, p), (_, t) in zip(srcs, texts)}, out, procs)


def _follow(path: str, args: argparse.Namespace, offsets: Dict[str, int], out: TextIO, procs: LocalProcs, sleep: Callable[[float], None] = time.sleep) -> int:
    """Print what the logs gain, every FOLLOW_POLL_S, until the job ends (or Ctrl-C).

    Follows the rank across recoveries: a spare promoted to it is picked up from its events.
    A local job whose coordinator is gone without a summary ends the following too.
    """
    polls = 0
    try:
        while True:
            polls += 1
            run = load_run(path)
            srcs = log_sources(run, args.rank, args.worker, None, waiting=True)
            fresh = []
            for label, p in srcs:
                text, offsets[p] = _read_from(p, offsets.get(p, 0))
                if text:
                    fresh.append((label, text))
            for line in merge_logs(fresh):
                print(line, file=out, flush=True)
            if run.summary is not None or any(e.get("event") == "job_finished" and e.get("status") != "requeued" for e in run.current[-3:]):
                if not fresh:
                    return EXIT_OK
                continue
            if polls % 4 == 0 and not fresh and slurm_job_id(run) is None and run.events:
                coord = find_coordinator(run, procs, socket.gethostname())
                if coord.alive is False:
                    print(f"(the job ended without a summary: {coord.how})", file=out, flush=True)
                    return EXIT_OK
            sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return EXIT_OK


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _read_from(path: str, offset: int) -> Tuple[str, int]:
    """Whole lines appended since ``offset`` (a half-written last line waits for next time)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return "", offset
    cut = data.rfind(b"\n") + 1
    return data[:cut].decode("utf-8", errors="replace"), offset + cut


def cmd_cancel(args: argparse.Namespace, out: TextIO, procs: LocalProcs, queue: SlurmQueue, sleep: Callable[[float], None] = time.sleep) -> int:
    run = _load_all([args.run_dir])[0]
    job = slurm_job_id(run)
    if run.summary is not None and not (job and _unfinished(run)):
        print(f"{run.path}: nothing to cancel, the job already ended ({run.summary['status']}, exit {run.summary['exit_code']})", file=out)
        return EXIT_OK
    if job:
        try:
            queue.cancel(job)
        except Exception as e:  # noqa: BLE001 - SlurmCommandError names the command and its stderr
            print(f"{run.path}: could not cancel Slurm job {job}: {e}", file=out)
            return EXIT_FAILED
        print(f"{run.path}: scancel {job} sent (Slurm ends the batch step and every worker step)", file=out)
        return EXIT_OK
    coord = find_coordinator(run, procs, socket.gethostname())
    if coord.alive is None:
        raise UsageError(f"cannot cancel {run.path} from here: the job {coord.how}. HINT: run `{PROG} cancel` on that host")
    stopped = True
    if coord.alive and coord.pid:
        procs.signal(coord.pid, signal.SIGKILL if args.force else signal.SIGTERM)
        stopped = _wait_gone(procs, [coord.pid], args.timeout_s, sleep)
        if not stopped:
            print(f"{run.path}: coordinator pid {coord.pid} still alive {args.timeout_s:.0f} s after SIGTERM. HINT: {PROG} cancel --force {run.path} (SIGKILL)", file=out)
            return EXIT_FAILED
        after = load_run(run.path).summary
        ended = f"; summary.json: {after['status']} (exit {after['exit_code']})" if after else "; it wrote no summary.json"
        print(f"{run.path}: coordinator pid {coord.pid} stopped ({'SIGKILL' if args.force else 'SIGTERM'}){ended}", file=out)
    # workers end when their coordinator goes; a stopped (hung) one cannot notice: end it
    left = live_workers(run, procs)
    if left and not _wait_gone(procs, list(left.values()), min(args.timeout_s, 5.0), sleep):
        left = live_workers(run, procs)
        for pid in left.values():
            procs.signal(pid, signal.SIGKILL)
        print(f"{run.path}: killed {len(left)} worker(s) left behind: {', '.join(f'{w} (pid {p})' for w, p in sorted(left.items()))}", file=out)
    if not coord.alive and not left:
        print(f"{run.path}: nothing to cancel: {coord.how}, and no summary.json (the job ended without one)", file=out)
    return EXIT_OK


def cmd_drain(args: argparse.Namespace, out: TextIO, sleep: Callable[[float], None] = time.sleep) -> int:
    """Ask the job's coordinator (a file in RUN_DIR/requests/, rundir/requests.py) to move NODE's ranks."""
    run = _load_all([args.run_dir])[0]
    if run.summary is not None:
        raise UsageError(f"{run.path}: the job already ended ({run.summary['status']}): nothing to drain")
    nodes = {e.get("node") for e in run.of("node_started") if e.get("role") == "active"} | {e.get("node") for e in run.of("spare_promoted")}
    if args.node not in nodes:
        raise UsageError(
            f"{run.path}: node {args.node!r} never trained in this job (its training nodes: {', '.join(sorted(n for n in nodes if n)) or 'none yet'}). HINT: name one of those"
        )
    path = requests.write(run.paths.requests, "drain", node=args.node, reason=args.reason)
    print(f"{run.path}: drain of {args.node} requested ({os.path.basename(path)}): its ranks move to a hot spare at the next step boundary", file=out)
    deadline = time.monotonic() + args.wait_s
    while time.monotonic() < deadline:
        now = load_run(run.path)
        asked = [e for e in now.of("drain_requested") if e.get("request") == os.path.basename(path)]
        if asked and asked[-1].get("refused"):
            print(f"{run.path}: refused: {asked[-1]['refused']}", file=out)
            return EXIT_FAILED
        moved = [e for e in now.of("moved") if args.node in (e.get("nodes") or ())]
        if moved:
            print(f"{run.path}: moved at step {moved[-1].get('planned_step')}: downtime {moved[-1].get('downtime_s')} s", file=out)
            return EXIT_OK
        if now.summary is not None:
            print(f"{run.path}: the job ended ({now.summary['status']}) before the move", file=out)
            return EXIT_FAILED
        sleep(0.5)
    if args.wait_s:
        print(f"{run.path}: not moved within {args.wait_s:g} s (a spare may still be starting; ckptless-hpc status shows the job)", file=out)
        return EXIT_FAILED
    return EXIT_OK


def _wait_gone(procs: LocalProcs, pids: Iterable[int], timeout_s: float, sleep: Callable[[float], None]) -> bool:
    """Wait (backing off 0.05 s -> 1 s) until none of ``pids`` is alive."""
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    pids = list(pids)
    while any(procs.alive(p) for p in pids):
        if time.monotonic() >= deadline:
            return False
        sleep(pause)
        pause = min(2 * pause, 1.0)
    return True


# ============================================================================== plumbing
def _load_all(paths: Sequence[str]) -> List[Run]:
    runs = []
    for p in paths:
        try:
            runs.append(load_run(p))
        except RunDirError as e:
            raise UsageError(str(e)) from None
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Inspect and control ckptless_hpc runs. (Without one of these commands, ckptless-hpc runs a job: ckptless-hpc [hydra overrides])"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{report,status,logs,cancel,drain,export}")
    r = sub.add_parser(
        "report",
        help="text summary and PNG chart of a run; a comparison table of several",
        description="Text summary (recoveries and their phases, downtime, goodput, lost steps) and a PNG chart of a run; several run directories (or a Hydra sweep directory) give one comparison table and chart.",
    )
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (hydra.run.dir), or a sweep directory holding run directories")
    r.add_argument("--out", metavar="PNG", help="where to write the chart (default: RUN_DIR/report.png; for several runs, report.png in their common directory)")
    r.add_argument("--no-chart", action="store_true", help="print the text only")
    s = sub.add_parser(
        "status",
        help="is the run running, completed or failed; where it stands",
        description="State of runs: completed/failed from summary.json; otherwise running/recovering/ended from events.jsonl and the coordinator process (local) or squeue (Slurm, one call for all runs).",
    )
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    lg = sub.add_parser(
        "logs",
        help="the coordinator's log merged with one rank's log (rank 0 by default)",
        description="Show the coordinator log and one rank's worker log, merged by time. --rank R shows every worker that held rank R (a spare that replaced a failed worker takes its rank over).",
    )
    lg.add_argument("run_dir", metavar="RUN_DIR")
    who = lg.add_mutually_exclusive_group()
    who.add_argument("--rank", type=_nonneg_int, help="show the worker(s) that held this rank (default 0)")
    who.add_argument("--worker", metavar="NODE.I", help="show this worker's log (e.g. a spare: local2.0)")
    lg.add_argument("--gen", type=_nonneg_int, help="with --rank: only the worker that held it in this generation")
    lg.add_argument("--tail", type=_nonneg_int, metavar="N", help="only the last N lines")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends (Ctrl-C to stop)")
    c = sub.add_parser(
        "cancel", help="stop a running job", description="Stop a running job: SIGTERM to a local run's coordinator (its workers follow it), scancel for a Slurm job."
    )
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("--force", action="store_true", help="SIGKILL instead of SIGTERM (local)")
    c.add_argument("--timeout-s", type=float, default=15.0, help="how long to wait for the job to stop (default 15)")
    d = sub.add_parser(
        "drain",
        help="move a node's ranks to a hot spare at the next step boundary",
        description="Hand NODE's ranks to a hot spare at the next step boundary (every rank finishes the steps before it; none is aborted or redone), then stop NODE's workers and exclude it, as for maintenance. Refused (an event says why) for a node the job does not train on; waits for a spare when none is built.",
    )
    d.add_argument("run_dir", metavar="RUN_DIR")
    d.add_argument("node", metavar="NODE", help="a node the job trains on (its events name them: node_started)")
    d.add_argument("--reason", default="drained by ckptless-hpc drain", help="kept in the events and summary.json's moves")
    d.add_argument("--wait-s", type=float, default=0.0, help="wait up to this long for the move to be done (or refused); 0: return once asked")
    x = sub.add_parser(
        "export",
        help="the full model of a saved state, as one state_dict file",
        description="Write the model's full state_dict (unsharded) from a saved state: a run directory (its final state, else the copy its restart.json names), its final/ folder, a state folder (final, periodic, emergency; sharded or not), a state file, or a copy's DCP folder (final/dcp, saved/step<S>/dcp, state/dcp: the copy it was written from, else the checkpoint itself). Load it with model.load_state_dict(torch.load(PATH, weights_only=True)).",
    )
    x.add_argument("path", metavar="RUN_DIR_OR_COPY")
    x.add_argument("--out", metavar="PT", default=MODEL, help=f"where to write it (default: {MODEL})")
    x.add_argument(
        "--format",
        choices=("pt", "safetensors", "dcp"),
        default=None,
        help="pt (torch.load), safetensors (needs the safetensors package), or dcp (--out is a folder: the whole state, model and optimizer, "
        "as a torch.distributed.checkpoint checkpoint: docs/tasks.md); default: safetensors when --out ends in .safetensors, else pt",
    )
    return p


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    from ..state import export  # imports torch: only this command pays for it

    try:
        fmt = export.format_of(args.out, args.format)
        if fmt == "dcp":
            rec = export.export_dcp(args.path, args.out, build_model=lambda: _run_model(args.path))
            print(f"wrote {rec['path']}: the whole state of {args.path} as a DCP checkpoint ({rec['bytes'] / 1e6:.1f} MB): docs/tasks.md says how to load it", file=out)
            return EXIT_OK
        rec = export.write_model(export.load_full_model(args.path, build_model=lambda: _run_model(args.path)), args.out, fmt)
    except export.ExportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {rec['path']}: the full model of {args.path} ({rec['bytes'] / 1e6:.1f} MB, sha256 {rec['sha256']})", file=out)
    return EXIT_OK


def _run_model(path: str) -> Any:
    """A fresh model of the task of the run that wrote ``path`` (its .hydra/config.yaml, in the
    run directory at or above ``path``): only a model whose ``state_dict`` hooks make keys of
    their own needs it to be presented."""
    from omegaconf import OmegaConf
    from hydra.utils import instantiate

    from ..state.export import ExportError

    here = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path))
    while True:
        cfg_path = RunPaths(here).hydra_config
        if os.path.isfile(cfg_path):
            break
        if os.path.dirname(here) == here:
            raise ExportError(
                f"{path}: the model's state_dict hooks make keys of their own and no run directory above it names the task. HINT: export from the run directory (RUN_DIR/.hydra/config.yaml)"
            )
        here = os.path.dirname(here)
    try:
        task = instantiate(OmegaConf.load(cfg_path).task)
        return task.build_model()
    except Exception as e:  # the user's task: any failure, named
        raise ExportError(f"cannot build the task's model from {cfg_path} ({type(e).__name__}: {e}). HINT: run export where the task's module imports (PYTHONPATH)") from None


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (HINT: ranks and counts are 0, 1, 2, ...)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is negative (HINT: ranks and counts start at 0)")
    return v


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout, procs: Optional[LocalProcs] = None, queue: Optional[SlurmQueue] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
        return int(e.code or 0)
    procs = procs or LocalProcs()
    queue = queue or SlurmQueue()
    try:
        if args.command == "report":
            return cmd_report(args, out)
        if args.command == "status":
            return cmd_status(args, out, procs, queue)
        if args.command == "logs":
            if args.gen is not None and args.rank is None and args.worker is None:
                args.rank = 0
            return cmd_logs(args, out, procs)
        if args.command == "export":
            return cmd_export(args, out)
        if args.command == "drain":
            return cmd_drain(args, out)
        return cmd_cancel(args, out, procs, queue)
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `ckptless-hpc logs RUN | head`
        return EXIT_OK
