"""The coordinator: one per job, in the launching process (local) or the batch step (Slurm).

It owns membership (generation -> rank -> worker), detects failures (process exit, lost
control connection, missed heartbeats, collective errors reported by survivors), carries out
the recovery protocol of DESIGN.md (decided by recovery.RecoveryMachine), keeps the spare
pool, and writes events.jsonl and summary.json. It never sees training data or state: workers
talk to each other.

This is the shell: what rank 0's metrics mean is step_feed.py's, restart.json is restart.py's,
stragglers and silence are detector.py's, the console echo is progress.py's.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

from omegaconf import OmegaConf

from ..control import wire
from ..config import global_batch
from . import continuity, host, inbox, messages
from ..control.server import ControlServer, Handlers
from .messages import Endpoints
from .ending import EXIT_CANCELLED, EXIT_FAILED, EXIT_STARTUP, Ending
from .inbox import Built, Done, Eval, FaultFired, Fetched, Held, Joining, Metrics, Ready, TransferFailed
from ..launch import background
from ..metrics import DelayHistogram, EventLog, Recovery, StepLog, TensorBoardSink
from ..progress import ConsoleEcho, Progress
from ..rundir.record import Failures, RecordError
from ..faults import KILLS, faults_from_config, spare_fault_due
from .detector import StallMeter, StragglerWatch, StragglerWindow, silent_workers
from .membership import FATAL_AT_STARTUP, RECOVER, Membership, WorkerRec, loss_kind
from .planner import by_node, initial_ranks
from .recovery import Abort, Assign, Emit, Exclude, GiveUp, Lose, NewGeneration, Options as RecoveryOptions, RecoveryMachine, Reformed, ReleaseCommands
from .saved_copies import SavedCopies
from ..rundir.restart import Restart, shard_copy as _shard_copy, write as write_restart
from .sharding import Layout
from .step_feed import Resumed, StepFeed
from .tally import Arrivals
from .wakeup import Wakeup

log = logging.getLogger("ckptless_hpc.coordinator")


@dataclass
class _GenState:
    """What ending a job reads of one generation (a recovery's own tallies are in recovery.py)."""

    held: Dict[str, Held] = field(default_factory=dict)
    done: Dict[str, Done] = field(default_factory=dict)


class Coordinator(Ending):
    def __init__(self, cfg: Any, run_dir: str, launcher: Any, secret: str, job_id: str, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.launcher = launcher
        self.secret = secret
        self.job_id = job_id
        self.clock = clock
        c = cfg.cluster
        self.wpn = c.workers_per_node
        self.world = c.nodes * c.workers_per_node
        self.write_failures = Failures()  # the run record's writes that failed (record.py): said once, never raised
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), job_id, clock, on_error=self.write_failures.report)
        self.members = Membership(self.wpn)
        self.layout = Layout(cfg)
        self.gen = -1
        self.gens: Dict[int, _GenState] = {}
        self.pending: Dict[str, tuple] = {}  # failed worker -> (reason, detect time)
        self.faults = faults_from_config(cfg)
        self.faults_done: Set[int] = set()
        self._injected: Set[int] = set()
        self._doomed: Set[str] = set()  # spares told to fire a fault: never promoted (their death may land late)
        self.straggling = StragglerWindow()  # compute times per worker, from heartbeats (detector.py)
        self.straggler_watch = StragglerWatch(self.straggling, c.straggler_factor)
        self.fault_times: List[float] = []
        self.steps = StepLog()  # bounded: nothing here grows with the number of steps
        self.feed = StepFeed(self.steps, cfg.train.steps, self.world, lambda: self.members.census())  # step_feed.py decides
        self.recoveries: List[Recovery] = []
        self.fatal: Optional[str] = None
        self.nonfinite: Optional[Dict[str, Any]] = None  # a rank refused a non-finite step (train.on_nonfinite=stop)
        self.skipped: Dict[str, int] = {}  # steps dropped so far, by cause (rank 0's count)
        self.last_metrics: Optional[Dict[str, float]] = None  # the task's own metrics of the last step
        self.last_eval: Optional[Dict[str, Any]] = None  # {"step", "metrics"} of the last evaluation
        self.tensorboard: Optional[TensorBoardSink] = None
        self.stopping = False
        self.reform_requested = False
        self.recovery: Optional[RecoveryMachine] = None  # the recovery in progress (recovery.py decides, _recover carries out)
        self.saved: Optional[Dict[str, Any]] = None
        self.final: Optional[Dict[str, Any]] = None  # train.save_final: what the final save wrote (ending.py)
        self.copies = SavedCopies(run_dir, self.layout.shards, int(cfg.train.get("keep_saved", 2)), self.layout.mode)  # train.save_every
        self.shard_saves: Dict[int, Dict[str, Any]] = {}  # sharded emergency copy: shard -> its file
        self.save_error: Optional[str] = None  # the emergency copy could not be written (why)
        self.save_requested: Optional[str] = None  # preemption / time limit: save once, then requeue
        self.cancel_requested: Optional[str] = None  # SIGTERM / SIGINT / ckptless-hpc cancel
        self.resume: Optional[Dict[str, Any]] = None  # emergency copy to start from (after a requeue)
        self.summary: Dict[str, Any] = {}
        self.store: Any = None
        self.wakeup = Wakeup()
        self._t_start = clock()
        self.progress = Progress(cfg.train.steps, cfg.train.log_every)
        self.console = ConsoleEcho(self.progress, self._console_log)
        self._t_train: Optional[float] = None
        self._config: Optional[Dict[str, Any]] = None
        self.stalls = StallMeter(c.heartbeat_interval_s, clock())
        self.hb_delay = DelayHistogram()  # heartbeat sent (worker's clock) -> read here
        self._calls: Optional[ThreadPoolExecutor] = None  # launcher calls that wait for the scheduler
        handlers = Handlers(self._on_hello, self._on_message, self._lost, self._welcome_msg, self._emit, lambda: self.gen)
        self.control = ControlServer(self.members.workers, secret, clock, handlers, self.stalls, self.straggling, self.hb_delay)  # control/server.py
        self._refilling = asyncio.Lock()  # one spare refill at a time (_refill)

    # ------------------------------------------------------------------ membership (membership.py decides)
    @property
    def workers(self) -> Dict[str, WorkerRec]:
        return self.members.workers

    @property
    def ranks(self) -> Dict[int, str]:
        return self.members.ranks

    @ranks.setter
    def ranks(self, value: Dict[int, str]) -> None:
        self.members.ranks = value

    @property
    def bad_nodes(self) -> Set[str]:
        return self.members.bad_nodes

    @property
    def active_nodes(self) -> Set[str]:
        return self.members.active_nodes

    # ------------------------------------------------------------------ helpers
    def _notify(self) -> None:
        """Something changed: wake the waiters once per loop iteration, not once per message."""
        self.wakeup.notify()

    async def _until(self, cond: Callable[[], bool], timeout_s: Optional[float]) -> bool:
        return await self.wakeup.until(cond, timeout_s)

    def _config_dict(self) -> Dict[str, Any]:
        """The resolved config every worker is sent: resolved once, not once per connection."""
        if self._config is None:
            self._config = OmegaConf.to_container(self.cfg, resolve=True)
        return self._config

    def _g(self, gen: int) -> _GenState:
        return self.gens.setdefault(gen, _GenState())

    def _emit(self, event: str, rec: Optional[WorkerRec] = None, **kw: Any) -> Dict[str, Any]:
        if rec is not None:
            kw.setdefault("rank", rec.rank)
            kw.setdefault("node", rec.node)
            kw.setdefault("worker", rec.wid)
        kw.setdefault("gen", self.gen)
        return self.events.emit(event, **kw)

    def _on_hello(self, rec: WorkerRec, hello: Dict[str, Any], relayed: bool) -> None:
        self.launcher.register(rec.wid, hello)
        self._emit("worker_connected", rec, pid=rec.pid, slurm_step=hello.get("slurm_step"), relayed=relayed or None)

    def _welcome_msg(self, rec: WorkerRec) -> Dict[str, Any]:
        return {"type": "config", "job": self.job_id, "config": self._config_dict(), "store": self.store_addr, "run_dir": self.run_dir, "spare": rec.role == "spare"}

    def _on_message(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        try:
            self._dispatch(rec, msg)
        except (KeyError, ValueError, TypeError) as e:
            log.error("gen=%s rank=%s node=%s: malformed %r message from %s (%s: %s); closing its connection", self.gen, rec.rank, rec.node, msg.get("type"), rec.wid, type(e).__name__, e)
            self._lost(rec, f"malformed {msg.get('type')!r} message ({type(e).__name__}: {e})")
        self._notify()

    def _dispatch(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        m = inbox.parse(msg)
        if m is None:
            log.warning("unknown message %r from %s", msg.get("type"), rec.wid)
            return
        if isinstance(m, Built):
            rec.built, rec.state_port = True, m.state_port
            kind = "spare_ready" if rec.role == "spare" else "worker_ready"
            self._emit(kind, rec, state_bytes=m.state_bytes, params=m.params, state_port=m.state_port, buckets=m.buckets, buffers=m.buffers)
        elif isinstance(m, Metrics):
            self._on_metrics(rec, m)
        elif isinstance(m, Eval):
            self._on_eval(rec, m)
        elif isinstance(m, Held):
            self._on_held(rec, m)
        elif isinstance(m, (Ready, Joining, Fetched)):
            if isinstance(m, Ready) and m.rank is not None:
                rec.ready_rank = m.rank
            if self.recovery is not None:
                self.recovery.on_message(rec.wid, m)
            if isinstance(m, Fetched):
                self._emit("state_transferred", rec, source=m.source, bytes=m.bytes, seconds=m.seconds)
        elif isinstance(m, TransferFailed):
            self._emit("transfer_error", rec, source=m.source, error=m.error)
        elif isinstance(m, FaultFired):
            self.faults_done.add(m.index)
            self.control.send(rec, {"type": "fault_ack", "index": m.index})  # recorded: the worker may now fire it
            ev = self._emit("fault_injected", rec, step=m.step, kind=m.kind, index=m.index, pid=m.pid)
            if m.kind in KILLS:  # only a fault that fails a rank can be a recovery's t_fail (not a straggler, a spare, the wire)
                self.fault_times.append(ev["time"])  # the recovery's t_fail is this event's time
            self._persist()
        elif isinstance(m, Done):
            self._g(m.gen).done[rec.wid] = m
        else:
            self._on_outcome(rec, m)

    def _on_held(self, rec: WorkerRec, m: Held) -> None:
        if m.abort_gen is not None:
            self._g(m.abort_gen).held[rec.wid] = m
            if self.recovery is not None:
                self.recovery.on_message(rec.wid, m)
        elif str(m.reason).startswith("start failed") and m.gen == self.gen and not self.stopping:
            if self.recovery is not None:
                self.recovery.on_start_failed(rec.wid, m.gen, str(m.reason), m.blame or ())
            self._emit("start_failed", rec, step=m.step, reason=m.reason)
            self._notify()
        elif not self.stopping and rec.role == "active" and m.gen == self.gen:
            log.info("rank %s reported: %s", rec.rank, str(m.reason)[:160])
            self._emit("collective_error", rec, step=m.step, reason=m.reason)
            asyncio.ensure_future(self._reform_if_unexplained(self.gen))

    def _on_metrics(self, rec: WorkerRec, m: Metrics) -> None:
        now = self.clock()
        back = self.feed.on_step(m, now)
        extra = {"metrics": m.metrics} if m.metrics else {}
        self._emit("step", rec, step=m.step, loss=m.loss, lr=m.lr, grad_norm=m.grad_norm, step_s=m.step_s, skipped=m.skipped, at=now, **extra)
        self.skipped = m.skipped_total or self.skipped
        self.last_metrics = m.metrics or self.last_metrics
        if self.tensorboard is not None:
            self.tensorboard.step(m.step, m.loss, m.lr, m.grad_norm, m.step_s, m.samples / m.step_s if m.samples and m.step_s > 0 else None)
            self.tensorboard.scalars("train", m.step, m.metrics)
        self._fault_a_spare(m.step)
        ahead = self.copies.timed(now, m.step, float(self.cfg.train.get("save_every_s", 0.0)))
        if ahead is not None:  # train.save_every_s: every rank copies that step (worker/periodic.py)
            self.control.broadcast(self.ranks.values(), {"type": "copy_at", "step": ahead})
        if back is not None:
            self._resumed(rec, m.step, back, now)
        self.progress.update(self.feed.snapshot(m, now, self._t_train, len(self.recoveries), self.gen))

    def _on_eval(self, rec: WorkerRec, m: Eval) -> None:
        """An evaluation (a recovered generation that starts at an evaluation step redoes it: same values)."""
        self._emit("eval", rec, step=m.step, metrics=m.metrics, eval_s=m.eval_s)
        self.last_eval = {"step": m.step, "metrics": m.metrics}
        if self.tensorboard is not None:
            self.tensorboard.scalars("eval", m.step, m.metrics)
        self.progress.note(f"eval at step {m.step}: " + " ".join(f"{k} {v:.4f}" for k, v in sorted(m.metrics.items())))

    def _fault_a_spare(self, step: int) -> None:
        """A kill_spare fault due at this step is sent to a connected spare, never promoted after."""
        f = spare_fault_due(self.faults, self.faults_done | self._injected, step) if self.faults else None
        spare = None if f is None else self.members.connected_spare()
        if f is not None and spare is not None:
            self._injected.add(f.index)
            self._doomed.add(spare.wid)
            self.control.send(spare, {"type": "inject", "index": f.index})

    def _resumed(self, rec: WorkerRec, step: int, back: Resumed, now: float) -> None:
        if back.refills:
            asyncio.ensure_future(self._refill())
        rep = back.recovery.report()
        self._emit("resumed", rec, step=step, downtime_s=rep["downtime_s"], at=now)
        if self.tensorboard is not None:
            self.tensorboard.recovery(step, rep)
        log.info(
            "recovered: downtime %.2fs (detect %.2f, reconfigure %.2f, transfer %.2f, resume %.2f)",
            rep["downtime_s"], rep["detect_s"], rep["reconfigure_s"], rep["transfer_s"], rep["resume_s"],
        )

    def _lost(self, rec: WorkerRec, reason: str) -> None:
        """A worker is gone (exit, lost connection, silence). Idempotent."""
        if rec.role == "dead" or self.stopping:
            return
        t_detect = self.clock()
        if rec.rank is not None and rec.rank == self.cfg.train.console_rank:
            self._echo_once()  # its last lines (a traceback, say) before the rank moves on
        was = self.members.lose(rec.wid)
        if rec.writer is not None:
            self.control.drop(rec, reason)
        kind = loss_kind(was, self._t_train is not None)
        if kind == RECOVER:  # nothing the recovery does needs the scheduler: its commands wait for the promotion
            self.launcher.hold_commands()
        self.launcher.kill_worker(rec.wid)
        self._emit("failure_detected", rec, reason=reason, role=was, at=t_detect)
        log.warning("worker %s (node %s, rank %s, %s) failed: %s", rec.wid, rec.node, rec.rank, was, reason)
        if kind == FATAL_AT_STARTUP:
            self.fatal = self.fatal or f"worker {rec.wid} on node {rec.node} died during start-up: {reason}\n{self._log_tail(rec.wid)}"
        elif kind == RECOVER:
            self.pending[rec.wid] = (reason, t_detect)
        else:
            self._exclude(rec.node, f"spare {rec.wid} failed: {reason}")
            asyncio.ensure_future(self._refill())
        if getattr(self.launcher, "node_is_one_step", False):  # its node's step ended with it: the node's ranks are lost together, one failure
            for mate in self.members.node_mates(rec.wid):
                self._lost(self.workers[mate], f"its node's step ended with worker {rec.wid} ({reason})")
        self._notify()

    def _exclude(self, node: str, why: str) -> None:
        idle = self.members.exclude(node)
        if idle is None:
            return
        self._emit("node_excluded", node=node, reason=why)
        self.launcher.exclude_node(node, why)
        self._persist()
        for wid in idle:  # idle spares of a bad node are never promoted
            self.launcher.kill_worker(wid)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A launcher call that waits for the scheduler's answer (squeue, scontrol requeue): in a
        thread of its own, one at a time, so that the loop keeps reading heartbeats."""
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher-calls")
        return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

    def command_done(self, outcome: Dict[str, Any]) -> None:
        """A queued scheduler command finished (from the launcher's command thread): an event."""
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._command_done, outcome)
        else:
            self._command_done(outcome)

    def _command_done(self, outcome: Dict[str, Any]) -> None:
        rec = self.workers.get(outcome.get("worker", ""))
        self._emit("scheduler_command", rec, step=self.steps.last_step, **background.event_fields(outcome))
        log.log(*background.describe(outcome, self.gen, rec.rank if rec else None, self.steps.last_step))

    def on_process_exit(self, wid: str, rc: int) -> None:
        rec = self.workers.get(wid)
        if rec is not None:
            self._lost(rec, f"process exited with code {rc}")

    def _log_tail(self, wid: str, lines: int = 30) -> str:
        try:
            with open(self.launcher.log_path(wid), encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    async def _heartbeat_watch(self) -> None:
        c = self.cfg.cluster
        self.stalls.last_tick = self.clock()
        while not self.stopping:
            await asyncio.sleep(c.heartbeat_interval_s)
            late = self.stalls.tick(self.clock())
            if late > c.heartbeat_interval_s:
                self._emit("coordinator_stalled", seconds=round(late, 3))
                log.warning("the coordinator itself stalled for %.2fs: not counted as any worker's silence", late)
            await asyncio.sleep(0)  # what arrived during a stall is read before anyone is judged
            self._judge_silence(self.stalls.last_tick)
            self._watch_stragglers()

    def _judge_silence(self, now: float) -> None:
        # still building (importing torch, building the model on a loaded machine): its
        # process exit is watched; silence is judged once it is built
        live = self.members.watched()
        seen = {w.wid: w.last_seen for w in live}
        at = {w.wid: w.seen_stall for w in live}
        silent = silent_workers(now, seen, seen.keys(), self.cfg.cluster.heartbeat_timeout_s, self.stalls.stalled_s, at, self.control.unread)
        for wid, reason in silent:
            self._lost(self.workers[wid], reason)

    def _watch_stragglers(self) -> None:
        active = {r: w for r, w in self.ranks.items() if self.workers[w].role == "active"}
        slow, cleared = self.straggler_watch.judge(active)
        for r, ratio in slow.items():
            self._emit("straggler", self.workers[active[r]], ratio=round(ratio, 2), compute_s=self.straggling.times[active[r]], window=self.straggling.size)
            log.warning("rank %d is a straggler: %.1fx slower than the typical rank (reported, not failed)", r, ratio)
        for r in cleared:
            if r in self.ranks:
                self._emit("straggler_recovered", self.workers[self.ranks[r]])

    async def _reform_if_unexplained(self, gen: int) -> None:
        """A survivor saw a collective fail but nobody is known dead: re-form after a grace."""
        await asyncio.sleep(self.cfg.cluster.heartbeat_timeout_s + self.cfg.cluster.heartbeat_interval_s)
        if self.gen == gen and not self.pending and not self.stopping:
            self.reform_requested = True
            self._notify()

    # ------------------------------------------------------------------ lifecycle
    async def _start_node(self, name: str, role: str) -> None:
        self.members.add_node(name, role)
        started = await self.launcher.start_node(name, self.wpn, self.address, self.on_process_exit)
        launched = getattr(self.launcher, "launched_identity", lambda w: None)
        self._emit("node_started", node=name, role=role, workers=self.wpn, identities={w: launched(w) for w in started or ()})

    def _make_store(self) -> None:
        """The rendezvous store (authenticated, bound to cluster.bind_host only: rendezvous.py)."""
        from ..control.rendezvous import StoreServer

        loop = self._loop
        self.store = StoreServer(self.host, self.secret, on_reject=lambda peer, err: loop.call_soon_threadsafe(self._store_rejected, peer, err))
        self.store_addr = f"{self.host}:{self.store.port}"

    def _store_rejected(self, peer: Any, error: str) -> None:
        self._emit("connection_rejected", peer=str(peer), error=error, port="store")

    async def run(self) -> int:
        c = self.cfg.cluster
        self._loop = asyncio.get_running_loop()
        self.host = wire.resolve_host(c.bind_host)
        host.raise_fd_limit((c.nodes + c.spare_nodes + c.max_refills) * self.wpn)
        self.address = await self.control.listen(self.host, host.listen_backlog())
        self._emit("job_started", address=self.address, coordinator_pid=os.getpid(), host=socket.gethostname(), world=self.world, nodes=c.nodes, workers_per_node=self.wpn, spare_nodes=c.spare_nodes)
        log.info("coordinator for job %s listening on %s; run dir %s", self.job_id, self.address, self.run_dir)
        log.info("%s", self.layout.describe())
        log.info("%s", global_batch(self.cfg))
        self._emit("layout", mode=self.layout.mode, survives_node_losses=self.layout.survives(), describe=self.layout.describe())
        # the store's module imports torch (~1.5 CPU-s): in a thread while the nodes start (a local
        # node's start waits for the zygote's own torch import: launch/local.py)
        store_module = self._loop.run_in_executor(None, importlib.import_module, "ckptless_hpc.control.rendezvous")
        active, spare = await self._off_loop(self.launcher.initial_nodes, self.bad_nodes)
        for name in active:
            await self._start_node(name, "active")
        for name in spare:
            await self._start_node(name, "spare")
        self.members.active_nodes = set(active)
        await store_module
        self._make_store()
        self._emit("store_ready", address=self.store_addr)
        self.control.ready.set()
        self._persist()
        if self.cfg.train.tensorboard:
            self.tensorboard = TensorBoardSink(os.path.join(self.run_dir, "tensorboard"), on_error=self.write_failures.report)
        watch = asyncio.ensure_future(self._heartbeat_watch())
        echo = asyncio.ensure_future(self.console.follow(lambda: self.stopping))
        thresholds = gc.get_threshold()
        gc.set_threshold(*host.GC_THRESHOLDS)  # start-up builds a record and a connection per worker: fewer full collections
        try:
            code = await self._main()
        finally:
            gc.unfreeze()
            gc.set_threshold(*thresholds)
            self.stopping = True
            watch.cancel()
            echo.cancel()
            await self._shutdown()
            if self.tensorboard is not None:
                self.tensorboard.close()
            self._echo_once()  # the rank's last lines, written while it stopped
            self.control.close()
            if self._calls is not None:
                self._calls.shutdown(wait=False)
        return code

    def _echo_once(self) -> None:
        """Copy the new log lines of the worker now holding ``train.console_rank`` to the console."""
        self.console.once()

    def _console_log(self) -> Optional[str]:
        r = self.cfg.train.console_rank
        wid = self.ranks.get(r) if r is not None else None
        return self.launcher.log_path(wid) if wid else None

    async def _main(self) -> int:
        c = self.cfg.cluster
        starters = [w for w in self.workers.values() if w.role == "active"]
        built = Arrivals([w.wid for w in starters], lambda wid: self.workers[wid].built)
        ok = await self._until(lambda: self.fatal is not None or self.cancel_requested is not None or built(), c.startup_timeout_s)
        if self.cancel_requested:
            return self._finish(EXIT_CANCELLED, "cancelled", self.cancel_requested)
        if self.fatal or not ok:
            missing = built.missing()
            named = f"{missing}" if len(missing) <= 20 else f"{missing[:20]} and {len(missing) - 20} more"
            self.fatal = self.fatal or f"workers {named} did not start within cluster.startup_timeout_s={c.startup_timeout_s}s"
            return self._finish(EXIT_STARTUP, "startup_failed", self.fatal)
        self.ranks = initial_ranks(by_node((w.wid, w.node) for w in starters))
        self.gen = 0
        self._t_train = self.clock()
        step0 = self.resume["step"] if self.resume else 0
        self._assign(self.ranks, step0, {}, load=self.resume)
        host.settle_gc()
        self._emit("generation_started", world=self.world, step=step0, resumed_from=self.resume, ranks={str(r): w for r, w in self.ranks.items()})
        while True:
            await self._until(
                lambda: bool(self.pending or self.save_requested or self.cancel_requested or self.nonfinite)
                or self.reform_requested
                or self.fatal is not None
                or self._all_done(),
                None,
            )
            if self.cancel_requested:
                return self._finish(EXIT_CANCELLED, "cancelled", self.cancel_requested)
            if self.fatal:
                return self._finish(EXIT_FAILED, "failed", self.fatal)
            if self.nonfinite and not self.pending:
                return await self._stop_nonfinite(self.nonfinite)
            if self.save_requested and not self._all_done():
                return await self._save_and_requeue(self.save_requested, self._quiesce_targets())
            if self.pending or self.reform_requested:
                code = await self._recover()
                if code is not None:
                    return code
                continue
            return await self._complete()

    def _all_done(self) -> bool:
        done = self._g(self.gen).done
        return len(done) == self.world and all(w in done for w in self.ranks.values())

    def _assign(self, ranks: Dict[int, str], step: int, sources: Dict[str, List[str]], load: Optional[Dict[str, Any]] = None) -> None:
        """Every rank's assign. A survivor that keeps the rank it last said it was ready as, with
        nothing to fetch or load (most of a recovery's ranks), gets one shared message without a
        rank, encoded once (and one entry per node's relay): at 10k ranks, 10k encodings fewer."""
        done = sorted(self.faults_done)
        ends = Endpoints(self.workers)
        self.members.assign(ranks)
        if self.layout.sharded:
            self.layout.place({r: self.workers[w].node for r, w in ranks.items()})
        keeping = []
        for r, wid in ranks.items():
            extra = self.layout.assign_fields(r, ranks, ends)
            if not extra and not load and wid not in sources and self.workers[wid].ready_rank == r:
                keeping.append(wid)
                continue
            shard_load = _shard_copy(load, extra.get("shard"))
            self.control.send(self.workers[wid], messages.assign(self.gen, r, self.world, step, sources.get(wid, ()), ends, done, shard_load, extra))
        if keeping:
            self.control.broadcast(keeping, messages.assign(self.gen, None, self.world, step, (), ends, done))

    # ------------------------------------------------------------------ recovery
    async def _recover(self) -> Optional[int]:
        """Carry out one recovery: its decisions are ``recovery.RecoveryMachine``'s."""
        c = self.cfg.cluster
        m = self.recovery = RecoveryMachine(self.members, self.layout, RecoveryOptions.from_cluster(c), self.gen, self._doomed, self.fault_times)
        try:
            timed_out = False
            while True:
                if self.cancel_requested:  # a cancel never waits for the recovery (it may be stuck on a peer that never answers)
                    return self._finish(EXIT_CANCELLED, "cancelled", self.cancel_requested)
                failures, self.pending = self.pending, {}
                now = self.clock()
                for a in m.advance(max(now, m.deadline or now) if timed_out else now, failures):
                    if isinstance(a, GiveUp):
                        return await self._save_and_requeue(a.reason, dict(a.survivors), dict(a.held_steps), state_lost=a.state_lost)
                    if isinstance(a, Reformed):
                        self._reformed(a.record, a.plan)
                        return None
                    self._carry_out(a)
                if self.pending or m.satisfied():
                    timed_out = False
                    continue
                left = None if m.deadline is None else max(0.0, m.deadline - self.clock())
                timed_out = not await self._until(lambda: bool(self.pending or self.cancel_requested) or m.satisfied(), left)
        finally:
            self.recovery = None
            self.launcher.release_commands()  # whatever the outcome: the queued scheduler commands run

    def _carry_out(self, a: Any) -> None:
        if isinstance(a, NewGeneration):
            self.gen = a.gen
            self.reform_requested = False  # this generation is the re-forming asked for
        elif isinstance(a, Exclude):
            self._exclude(a.node, a.why)
        elif isinstance(a, Emit):
            self._emit(a.event, self.workers[a.worker] if a.worker else None, **a.fields)
        elif isinstance(a, Abort):
            self.control.broadcast(a.workers, {"type": "abort", "gen": a.gen})
        elif isinstance(a, Lose):
            self._lost(self.workers[a.worker], a.why)
        elif isinstance(a, Assign):
            self._assign(dict(a.ranks), a.step, a.sources)
        elif isinstance(a, ReleaseCommands):
            self.launcher.release_commands()  # promotion sent (or nothing to promote): now the scancel/scontrol of the failed nodes
        else:
            raise TypeError(f"unknown recovery action {a!r}")

    def _reformed(self, rec: Recovery, plan: Any) -> None:
        survivors = self._survivor_continuity(rec)
        self.recoveries.append(rec)
        self._emit(
            "reformed", step=plan.target_step, world=self.world, replacements=rec.replacements, bytes=rec.bytes_transferred, ranks={str(r): w for r, w in self.ranks.items()},
            at=rec.t_ready, survivors=survivors,
        )
        self.feed.reformed(rec, len(rec.replacements) if self.cfg.cluster.refill_spares else 0)  # refilled once it resumed

    def _survivor_continuity(self, rec: Any) -> Dict[str, Any]:
        """Are the survivors of this recovery the processes launched for them? Measured by the
        launcher, outside the control connection (continuity.py); their identities, for the event."""
        launched = getattr(self.launcher, "launched_identity", None)
        live = getattr(self.launcher, "live_identity", None)
        if launched is None or live is None:  # a launcher that cannot tell (a simulated one)
            return {}
        kept = [w for w in self.ranks.values() if w not in rec.replacements.values()]
        now = {w: live(w) for w in kept}
        restarted, unmeasured = continuity.compare({w: launched(w) for w in kept}, now)
        rec.survivors_restarted = len(restarted)
        rec.survivors_checked = len(kept) - len(unmeasured)
        for w, why in restarted.items():
            self._emit("survivor_restarted", self.workers[w], reason=why)
            log.error("survivor %s (rank %s, node %s) is not the process launched for it: %s", w, self.workers[w].rank, self.workers[w].node, why)
        return {w: now[w] for w in kept}

    async def _refill(self) -> None:
        """Start spare nodes until ``cluster.spare_nodes`` are kept (counted in nodes). One refill
        at a time, so that one asked while another runs counts the nodes that one started."""
        async with self._refilling:
            if self.stopping or not self.cfg.cluster.refill_spares:
                return
            for _ in range(self.members.spare_nodes_missing(self.cfg.cluster.spare_nodes)):
                name = await self._off_loop(self.launcher.free_node)
                if name is None:
                    self._emit("refill_skipped", reason="no free node left")
                    return
                await self._start_node(name, "spare")
                self._emit("spare_launched", node=name)

    def _quiesce_targets(self) -> Dict[int, str]:
        return self.members.survivors()

    def request_save(self, reason: str) -> None:
        """Thread-safe (a signal handler calls it): save once at a committed step, then requeue."""

        def apply() -> None:
            self.save_requested = reason
            self._notify()

        self._loop.call_soon_threadsafe(apply)

    def request_cancel(self, reason: str) -> None:
        """Stop the job (every worker), write the summary; from the loop's thread (a signal handler)."""
        self.cancel_requested = reason
        self._notify()

    def _persist(self) -> None:
        """What a requeued job needs: the emergency copy, nodes never to use again, faults fired.
        A write that fails is said once and leaves the previous restart.json as it was."""
        newest = max((c for c in (self.saved, self.copies.newest, self.resume) if c), key=lambda c: c["step"], default=None)
        try:
            write_restart(self.run_dir, Restart.of(newest, self.bad_nodes, self.faults_done, self.launcher.batch_node))
        except RecordError as e:
            self.write_failures.report(e.path, f"{e}; a requeued job would resume from what it said before")

    def restore(self, state: Dict[str, Any]) -> None:
        """Start from a previous run's restart.json (after a requeue)."""
        r = Restart.from_json(state)
        self.resume, self.members.bad_nodes, self.faults_done = r.saved or self.resume, set(r.excluded_nodes), set(r.faults_done)

    async def _shutdown(self) -> None:
        for w in self.workers.values():
            if w.role != "dead" and w.writer is not None:
                self.control.send(w, {"type": "stop"})
            elif w.writer is None:  # still starting: it cannot hear a stop
                self.launcher.kill_worker(w.wid)
        self.control.close_relays()  # the stops leave now, then each relay passes them on and exits: its node's step can end
        await self.launcher.shutdown(self.cfg.cluster.exit_timeout_s)
        self.events.close()

