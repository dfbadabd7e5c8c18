"""The coordinator: one per job, in the launching process (local) or the batch step (Slurm).

It detects failures (process exit, lost control connection, missed heartbeats, collective
errors reported by survivors), carries out the recovery protocol of DESIGN.md and keeps the
spare pool. It never sees training data or state: workers talk to each other.

This is the shell, an asyncio loop that carries out actions; its collaborators are passed in
(``from_config`` builds them): what to do is the job machine's (job.py, running recovery.py),
the sockets are the control server's (control/server.py), the processes the launcher's, the
files the run record's (record.py), how a job ends the saver's (saving.py, verdicts.py), the
steps and the console telemetry.py's, silence and stragglers health.py's."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

from omegaconf import OmegaConf

from ..config import fault_list, global_batch
from ..control import wire
from ..control.server import ControlServer, Handlers
from ..faults import faults_from_config
from ..control import messages
from . import continuity, host, scheduler_log
from .health import Health
from ..control.messages import Built, Config, CopyAt, Done, Eval, Exported, ExportFailed, FaultAck, FaultFired, Fetched, Held, Inject, Joining, LoadFailed, Metrics, NonFinite, PeriodicFailed, PeriodicSaved, Ready, Saved, SaveFailed, StartupError, Stop, TransferFailed
from .job import Complete, Finish, Inputs, JobMachine, LeaveRecovery, Options as JobOptions, Phase, SaveAndRequeue, StartTraining, StopNonfinite
from .membership import FATAL_AT_STARTUP, RECOVER, Membership, WorkerRec
from .planner import by_node, initial_ranks
from .record import RunRecord
from .recovery import Abort, Assign, Emit, Exclude, Lose, NewGeneration, Reformed, ReleaseCommands
from .saving import Saver
from .sharding import Layout
from .tally import Arrivals
from .telemetry import Telemetry
from .wakeup import Wakeup
from ..rundir.restart import shard_copy as _shard_copy

log = logging.getLogger("ckptless_hpc.coordinator")


class Endpoints:
    """A worker's (host, state port) by id, read on demand: no per-assign copy of all workers."""

    def __init__(self, workers: Dict[str, WorkerRec]) -> None:
        self._w = workers

    def __getitem__(self, wid: str) -> messages.Endpoint:
        w = self._w[wid]
        return w.host, w.state_port


class Coordinator:
    def __init__(self, cfg: Any, launcher: Any, job: JobMachine, control: ControlServer, record: RunRecord, health: Health, clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.launcher, self.job, self.control, self.record, self.health, self.clock = cfg, launcher, job, control, record, health, clock
        self.layout = job.layout
        self.wakeup = Wakeup()
        self.telemetry = Telemetry(cfg, job.world, lambda: self.members.census(), self._console_log)
        self.saver = Saver(cfg, record, job, self.layout, control, launcher, self._until, self._emit, self._persist, self._off_loop, self._finish)
        control.bind(Handlers(self._on_hello, self._on_message, self._lost, self._welcome_msg, self._emit, lambda: self.job.gen))
        self.store: Any = None
        self.store_addr: Optional[str] = None
        self.address: Optional[str] = None
        self._config: Optional[Dict[str, Any]] = None  # the resolved config every worker is sent: resolved once
        self._calls: Optional[ThreadPoolExecutor] = None  # launcher calls that wait for the scheduler
        self._refilling = asyncio.Lock()  # one spare refill at a time (_refill)
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str, launcher: Any, secret: str, job_id: str, clock: Callable[[], float] = time.time) -> "Coordinator":
        c = cfg.cluster
        layout = Layout(cfg)
        job = JobMachine(Membership(c.workers_per_node), layout, c.nodes * c.workers_per_node, JobOptions.from_cluster(c), faults_from_config(cfg))
        record = RunRecord.from_config(cfg, run_dir, job_id, clock, layout.shards, layout.mode)
        health = Health.from_cluster(c, clock())
        control = ControlServer(job.members.workers, secret, clock, health.stalls, health.straggling, health.hb_delay)
        return cls(cfg, launcher, job, control, record, health, clock)

    # ------------------------------------------------------------------ views (the collaborators own them)
    @property
    def members(self) -> Membership:
        return self.job.members

    @members.setter
    def members(self, value: Membership) -> None:
        """A membership built elsewhere (a test's): the job and the control server read it."""
        self.job.members, self.control.workers = value, value.workers

    workers = property(lambda self: self.job.members.workers)
    bad_nodes = property(lambda self: self.job.members.bad_nodes)
    steps = property(lambda self: self.telemetry.steps)
    events = property(lambda self: self.record.events)
    summary = property(lambda self: self.record.summary)
    hb_delay = property(lambda self: self.health.hb_delay)

    @property
    def ranks(self) -> Dict[int, str]:
        return self.job.members.ranks

    @ranks.setter
    def ranks(self, value: Dict[int, str]) -> None:
        self.job.members.ranks = value

    @property
    def gen(self) -> int:
        return self.job.gen

    @property
    def resume(self) -> Optional[Dict[str, Any]]:
        return self.record.resume

    @resume.setter
    def resume(self, value: Optional[Dict[str, Any]]) -> None:
        self.record.resume = value

    # ------------------------------------------------------------------ helpers
    def _notify(self) -> None:
        """Something changed: wake the waiters once per loop iteration, not once per message."""
        self.wakeup.notify()

    async def _until(self, cond: Callable[[], bool], timeout_s: Optional[float]) -> bool:
        return await self.wakeup.until(cond, timeout_s)

    def _emit(self, event: str, rec: Optional[WorkerRec] = None, **kw: Any) -> Dict[str, Any]:
        if rec is not None:
            kw.setdefault("rank", rec.rank)
            kw.setdefault("node", rec.node)
            kw.setdefault("worker", rec.wid)
        kw.setdefault("gen", self.job.gen)
        return self.record.events.emit(event, **kw)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A launcher call that waits for the scheduler's answer (squeue, scontrol requeue): in a
        thread of its own, one at a time, so that the loop keeps reading heartbeats."""
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher-calls")
        return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

    # ------------------------------------------------------------------ what the control server reads
    def _on_hello(self, rec: WorkerRec, hello: Dict[str, Any], relayed: bool) -> None:
        self.launcher.register(rec.wid, hello)
        self._emit("worker_connected", rec, pid=rec.pid, slurm_step=hello.get("slurm_step"), relayed=relayed or None)

    def _welcome_msg(self, rec: WorkerRec) -> Dict[str, Any]:
        if self._config is None:
            self._config = OmegaConf.to_container(self.cfg, resolve=True)
        return Config(self.record.job_id, self._config, self.store_addr, self.record.run_dir, rec.role == "spare").encode()

    def _on_message(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        try:
            self._dispatch(rec, msg)
        except (KeyError, ValueError, TypeError) as e:
            log.error("gen=%s rank=%s node=%s: malformed %r message from %s (%s: %s); closing its connection", self.gen, rec.rank, rec.node, msg.get("type"), rec.wid, type(e).__name__, e)
            self._lost(rec, f"malformed {msg.get('type')!r} message ({type(e).__name__}: {e})")
        self._notify()

    def _dispatch(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        m = messages.parse(msg)
        if m is None:
            log.warning("unknown message %r from %s", msg.get("type"), rec.wid)
        elif isinstance(m, Built):
            rec.built, rec.state_port = True, m.state_port
            self._emit("spare_ready" if rec.role == "spare" else "worker_ready", rec, state_bytes=m.state_bytes, params=m.params, state_port=m.state_port, buckets=m.buckets, buffers=m.buffers)
        elif isinstance(m, Metrics):
            self._on_metrics(rec, m)
        elif isinstance(m, Eval):
            self._emit("eval", rec, step=m.step, metrics=m.metrics, eval_s=m.eval_s)
            self.telemetry.eval(m)
        elif isinstance(m, Held):
            self._on_held(rec, m)
        elif isinstance(m, (Ready, Joining, Fetched)):
            if isinstance(m, Ready) and m.rank is not None:
                rec.ready_rank = m.rank
            if self.job.recovery is not None:
                self.job.recovery.on_message(rec.wid, m)
            if isinstance(m, Fetched):
                self._emit("state_transferred", rec, source=m.source, bytes=m.bytes, seconds=m.seconds)
        elif isinstance(m, TransferFailed):
            self._emit("transfer_error", rec, source=m.source, error=m.error)
        elif isinstance(m, FaultFired):
            self.control.send(rec, FaultAck(m.index).encode())  # recorded: the worker may now fire it
            ev = self._emit("fault_injected", rec, step=m.step, kind=m.kind, index=m.index, pid=m.pid)
            self.job.fault_fired(m.index, m.kind, ev["time"])  # a kill's recovery has this event's time as its t_fail
            self._persist()
        elif isinstance(m, Done):
            self.job.g(m.gen).done[rec.wid] = m
        else:
            self._on_outcome(rec, m)

    def _on_held(self, rec: WorkerRec, m: Held) -> None:
        kind = self.job.held(rec.wid, rec.role, m)
        if kind == "start_failed":
            self._emit("start_failed", rec, step=m.step, reason=m.reason)
            self._notify()
        elif kind == "collective_error":
            log.info("rank %s reported: %s", rec.rank, str(m.reason)[:160])
            self._emit("collective_error", rec, step=m.step, reason=m.reason)
            asyncio.ensure_future(self._reform_if_unexplained(self.gen))

    def _on_metrics(self, rec: WorkerRec, m: Metrics) -> None:
        now = self.clock()
        back = self.telemetry.step(m, now)
        extra = {"metrics": m.metrics} if m.metrics else {}
        self._emit("step", rec, step=m.step, loss=m.loss, lr=m.lr, grad_norm=m.grad_norm, step_s=m.step_s, skipped=m.skipped, at=now, **extra)
        doomed = self.job.spare_fault(m.step)
        if doomed is not None:
            self.control.send(self.workers[doomed[1]], Inject(doomed[0]).encode())
        ahead = self.record.copies.timed(now, m.step, float(self.cfg.train.get("save_every_s", 0.0)))
        if ahead is not None:  # train.save_every_s: every rank copies that step (worker/periodic.py)
            self.control.broadcast(self.ranks.values(), CopyAt(ahead).encode())
        if back is not None:
            if back.refills:
                asyncio.ensure_future(self._refill())
            rep = back.recovery.report()
            self._emit("resumed", rec, step=m.step, downtime_s=rep["downtime_s"], at=now)
            self.telemetry.resumed(m.step, rep)
        self.telemetry.show(m, now, self.record.t_train, len(self.record.recoveries), self.gen)

    def _on_outcome(self, rec: WorkerRec, m: Any) -> None:
        """Messages that end the job one way or another: saved, non-finite, start-up error."""
        r = self.record
        if isinstance(m, Saved) and m.shard is not None:  # one shard of a sharded emergency copy
            r.shard_saves[m.shard] = {"path": m.path, "step": m.step, "sha256": m.sha256}
            self._emit("state_saved", rec, step=m.step, path=m.path, shard=m.shard)
        elif isinstance(m, Saved):
            r.saved = {"path": m.path, "step": m.step, "sha256": m.sha256, "bytes": m.bytes, "written": m.written is not False}
            self._emit("state_saved" if m.written is not False else "state_kept", rec, step=m.step, path=m.path, bytes=m.bytes)
        elif isinstance(m, SaveFailed):
            r.save_error = m.error
            self._emit("save_failed", rec, step=m.step, path=m.path, error=m.error)
        elif isinstance(m, PeriodicSaved):
            copy = r.copies.add(m)
            if copy is not None:
                self._emit("state_saved", rec, step=m.step, path=copy["path"], periodic=True)
                self._persist()
        elif isinstance(m, PeriodicFailed):
            self._emit("save_failed", rec, step=m.step, path=m.path, error=m.error, periodic=True)
        elif isinstance(m, Exported):
            r.final = {"model": m.model, "state": m.state, "step": m.step}
            self._emit("final_saved", rec, step=m.step, model=m.model["path"], sha256=m.model["sha256"], state=m.state["path"])
        elif isinstance(m, ExportFailed):
            r.final = {"error": m.error}
            self._emit("save_failed", rec, path=m.path, error=m.error)
        elif isinstance(m, LoadFailed):
            self.job.fail(f"the requeued job cannot resume: {m.error}")
            self._emit("load_failed", rec, path=m.path, error=m.error)
        elif isinstance(m, NonFinite):
            if self.job.nonfinite is None:
                self.job.nonfinite = {"step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "rank": m.rank, "held": m.held, "worker": rec.wid, "node": rec.node, "skipped": m.skipped}
                self._emit("nonfinite", rec, step=m.step, loss=m.loss, grad_norm=m.grad_norm)
        elif isinstance(m, StartupError):
            self.job.fatal = f"worker {rec.wid} on node {rec.node} failed at start-up:\n{m.traceback.rstrip()}"

    # ------------------------------------------------------------------ losses
    def _lost(self, rec: WorkerRec, reason: str) -> None:
        """A worker is gone (exit, lost connection, silence). Idempotent."""
        if rec.role == "dead" or self.job.stopping:
            return
        t_detect = self.clock()
        if rec.rank is not None and rec.rank == self.cfg.train.console_rank:
            self.telemetry.console.once()  # its last lines (a traceback, say) before the rank moves on
        was = self.members.lose(rec.wid)
        if rec.writer is not None:
            self.control.drop(rec, reason)
        kind = self.job.lost(rec.wid, was, reason, t_detect)
        if kind == RECOVER:  # nothing the recovery does needs the scheduler: its commands wait for the promotion
            self.launcher.hold_commands()
        self.launcher.kill_worker(rec.wid)
        self._emit("failure_detected", rec, reason=reason, role=was, at=t_detect)
        log.warning("worker %s (node %s, rank %s, %s) failed: %s", rec.wid, rec.node, rec.rank, was, reason)
        if kind == FATAL_AT_STARTUP:
            self.job.fail(f"worker {rec.wid} on node {rec.node} died during start-up: {reason}\n{self._log_tail(rec.wid)}")
        elif kind != RECOVER:
            self._exclude(rec.node, f"spare {rec.wid} failed: {reason}")
            asyncio.ensure_future(self._refill())
        if self.launcher.node_is_one_step:  # its node's step ended with it: the node's ranks are lost together, one failure
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

    def command_done(self, outcome: Dict[str, Any]) -> None:
        """A queued scheduler command finished (from the launcher's command thread): an event."""
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._command_done, outcome)
        else:
            self._command_done(outcome)

    def _command_done(self, outcome: Dict[str, Any]) -> None:
        rec = self.workers.get(outcome.get("worker", ""))
        self._emit("scheduler_command", rec, step=self.steps.last_step, **scheduler_log.event_fields(outcome))
        log.log(*scheduler_log.describe(outcome, self.gen, rec.rank if rec else None, self.steps.last_step))

    async def _heartbeat_watch(self) -> None:
        c, stalls = self.cfg.cluster, self.health.stalls
        stalls.last_tick = self.clock()
        while not self.job.stopping:
            await asyncio.sleep(c.heartbeat_interval_s)
            late = stalls.tick(self.clock())
            if late > c.heartbeat_interval_s:
                self._emit("coordinator_stalled", seconds=round(late, 3))
                log.warning("the coordinator itself stalled for %.2fs: not counted as any worker's silence", late)
            await asyncio.sleep(0)  # what arrived during a stall is read before anyone is judged
            self._judge_silence(stalls.last_tick)
            self._watch_stragglers()

    def _judge_silence(self, now: float) -> None:
        # still building (importing torch, building the model on a loaded machine): its
        # process exit is watched; silence is judged once it is built
        for wid, reason in self.health.silent(now, self.members.watched(), self.control.unread):
            self._lost(self.workers[wid], reason)

    def _watch_stragglers(self) -> None:
        active = {r: w for r, w in self.ranks.items() if self.workers[w].role == "active"}
        slow, cleared = self.health.stragglers(active)
        for r, ratio in slow.items():
            self._emit("straggler", self.workers[active[r]], ratio=round(ratio, 2), compute_s=self.health.straggling.times[active[r]], window=self.health.straggling.size)
            log.warning("rank %d is a straggler: %.1fx slower than the typical rank (reported, not failed)", r, ratio)
        for r in cleared:
            if r in self.ranks:
                self._emit("straggler_recovered", self.workers[self.ranks[r]])

    async def _reform_if_unexplained(self, gen: int) -> None:
        """A survivor saw a collective fail but nobody is known dead: re-form after a grace."""
        await asyncio.sleep(self.cfg.cluster.heartbeat_timeout_s + self.cfg.cluster.heartbeat_interval_s)
        if self.job.reform_if_unexplained(gen):
            self._notify()

    # ------------------------------------------------------------------ lifecycle
    async def _start_node(self, name: str, role: str) -> None:
        self.members.add_node(name, role)
        started = await self.launcher.start_node(name, self.cfg.cluster.workers_per_node, self.address, self.on_process_exit)
        self._emit("node_started", node=name, role=role, workers=self.cfg.cluster.workers_per_node, identities={w: self.launcher.launched_identity(w) for w in started or ()})

    def _make_store(self, bind: str) -> None:
        """The rendezvous store (authenticated, bound to cluster.bind_host only: rendezvous.py)."""
        from ..control.rendezvous import StoreServer

        loop = self._loop
        self.store = StoreServer(bind, self.control.secret, on_reject=lambda peer, err: loop.call_soon_threadsafe(self._store_rejected, peer, err))
        self.store_addr = f"{bind}:{self.store.port}"

    def _store_rejected(self, peer: Any, error: str) -> None:
        self._emit("connection_rejected", peer=str(peer), error=error, port="store")

    async def run(self) -> int:
        c = self.cfg.cluster
        self._loop = asyncio.get_running_loop()
        bind = wire.resolve_host(c.bind_host)
        host.raise_fd_limit((c.nodes + c.spare_nodes + c.max_refills) * c.workers_per_node)
        self.address = await self.control.listen(bind, host.listen_backlog())
        self._emit("job_started", address=self.address, coordinator_pid=os.getpid(), host=socket.gethostname(), world=self.job.world, nodes=c.nodes, workers_per_node=c.workers_per_node, spare_nodes=c.spare_nodes)
        log.info("coordinator for job %s listening on %s; run dir %s", self.record.job_id, self.address, self.record.run_dir)
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
        self._make_store(bind)
        self._emit("store_ready", address=self.store_addr)
        self.control.ready.set()
        self._persist()
        if self.cfg.train.tensorboard:
            self.telemetry.open_tensorboard(self.record.paths.tensorboard, self.record.failures.report)
        watch = asyncio.ensure_future(self._heartbeat_watch())
        echo = asyncio.ensure_future(self.telemetry.console.follow(lambda: self.job.stopping))
        thresholds = gc.get_threshold()
        gc.set_threshold(*host.GC_THRESHOLDS)  # start-up builds a record and a connection per worker: fewer full collections
        try:
            code = await self._main()
        finally:
            gc.unfreeze()
            gc.set_threshold(*thresholds)
            self.job.end()
            watch.cancel()
            echo.cancel()
            await self._shutdown()
            self.telemetry.close_tensorboard()
            self.telemetry.console.once()  # the rank's last lines, written while it stopped
            self.control.close()
            if self._calls is not None:
                self._calls.shutdown(wait=False)
        return code

    def _console_log(self) -> Optional[str]:
        r = self.cfg.train.console_rank
        wid = self.ranks.get(r) if r is not None else None
        return self.launcher.log_path(wid) if wid else None

    async def _main(self) -> int:
        """Start, then carry out what the job machine decides until it ends the job."""
        starters = [w for w in self.workers.values() if w.role == "active"]
        built = Arrivals([w.wid for w in starters], lambda wid: self.workers[wid].built)
        job = self.job
        ok = await self._until(lambda: job.fatal is not None or job.cancel_requested is not None or built(), self.cfg.cluster.startup_timeout_s)
        code = await self._execute(job.advance(self.clock(), Inputs(built=ok, missing=() if ok else built.missing()))[0], starters)
        while code is None:
            timed_out = await self._wait()
            code = await self._execute(job.advance(self.clock(), Inputs(timed_out=timed_out))[0], starters)
        return code

    async def _wait(self) -> bool:
        """Until the job machine has something to decide; True when a recovery's deadline passed."""
        job = self.job
        if job.phase is not Phase.RECOVERING:
            await self._until(job.attention, None)
            return False
        if job.recovery_settled():
            return False
        m = job.recovery
        left = None if m.deadline is None else max(0.0, m.deadline - self.clock())
        return not await self._until(lambda: bool(job.pending or job.cancel_requested) or m.satisfied(), left)

    async def _execute(self, actions: List[Any], starters: List[WorkerRec]) -> Optional[int]:
        """Carry out the job machine's actions in order; the exit code once one ends the job."""
        code: Optional[int] = None
        for a in actions:
            if isinstance(a, Finish):
                code = self._finish(a.code, a.status, a.error)
            elif isinstance(a, StartTraining):
                self._start_training(starters)
            elif isinstance(a, SaveAndRequeue):
                survivors = a.survivors if a.survivors is not None else self.members.survivors()
                code = await self.saver.save_and_requeue(a.reason, survivors, a.held, a.state_lost)
            elif isinstance(a, StopNonfinite):
                code = await self.saver.stop_nonfinite(a.nonfinite)
            elif isinstance(a, Complete):
                code = await self.saver.complete()
            elif isinstance(a, LeaveRecovery):
                self.launcher.release_commands()  # whatever the recovery's outcome: the queued scheduler commands run
            else:
                self._carry_out(a)
        return code

    def _start_training(self, starters: List[WorkerRec]) -> None:
        self.ranks = initial_ranks(by_node((w.wid, w.node) for w in starters))
        self.record.t_train = self.clock()
        step0 = self.resume["step"] if self.resume else 0
        self._assign(self.ranks, step0, {}, load=self.resume)
        host.settle_gc()
        self._emit("generation_started", world=self.job.world, step=step0, resumed_from=self.resume, ranks={str(r): w for r, w in self.ranks.items()})

    def _assign(self, ranks: Dict[int, str], step: int, sources: Dict[str, List[str]], load: Optional[Dict[str, Any]] = None) -> None:
        """Every rank's assign. A survivor that keeps the rank it last said it was ready as, with
        nothing to fetch or load (most of a recovery's ranks), gets one shared message without a
        rank, encoded once (and one entry per node's relay): at 10k ranks, 10k encodings fewer."""
        done, world = sorted(self.job.faults_done), self.job.world
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
            self.control.send(self.workers[wid], messages.assign(self.gen, r, world, step, sources.get(wid, ()), ends, done, shard_load, extra))
        if keeping:
            self.control.broadcast(keeping, messages.assign(self.gen, None, world, step, (), ends, done))

    def _carry_out(self, a: Any) -> None:
        """One of the recovery machine's actions (recovery.py)."""
        if isinstance(a, NewGeneration):
            self.job.adopt(a)
        elif isinstance(a, Exclude):
            self._exclude(a.node, a.why)
        elif isinstance(a, Emit):
            self._emit(a.event, self.workers[a.worker] if a.worker else None, **a.fields)
        elif isinstance(a, Abort):
            self.control.broadcast(a.workers, messages.Abort(a.gen).encode())
        elif isinstance(a, Lose):
            self._lost(self.workers[a.worker], a.why)
        elif isinstance(a, Assign):
            self._assign(dict(a.ranks), a.step, a.sources)
        elif isinstance(a, ReleaseCommands):
            self.launcher.release_commands()  # promotion sent (or nothing to promote): now the scancel/scontrol of the failed nodes
        elif isinstance(a, Reformed):
            self._reformed(a.record, a.plan)
        else:
            raise TypeError(f"unknown recovery action {a!r}")

    def _reformed(self, rec: Any, plan: Any) -> None:
        survivors = self._survivor_continuity(rec)
        self.record.recoveries.append(rec)
        self._emit(
            "reformed", step=plan.target_step, world=self.job.world, replacements=rec.replacements, bytes=rec.bytes_transferred, ranks={str(r): w for r, w in self.ranks.items()},
            at=rec.t_ready, survivors=survivors,
        )
        self.telemetry.feed.reformed(rec, len(rec.replacements) if self.cfg.cluster.refill_spares else 0)  # refilled once it resumed

    def _survivor_continuity(self, rec: Any) -> Dict[str, Any]:
        """Are the survivors of this recovery the processes launched for them? Measured by the
        launcher, outside the control connection (continuity.py); their identities, for the event."""
        if not self.launcher.measures_identity:  # a launcher that cannot tell (a simulated one)
            return {}
        launched, live = self.launcher.launched_identity, self.launcher.live_identity
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
            for _ in range(self.job.refills()):
                name = await self._off_loop(self.launcher.free_node)
                if name is None:
                    self._emit("refill_skipped", reason="no free node left")
                    return
                await self._start_node(name, "spare")
                self._emit("spare_launched", node=name)

    def request_save(self, reason: str) -> None:
        """Thread-safe (a signal handler calls it): save once at a committed step, then requeue."""

        def apply() -> None:
            self.job.save_requested = reason
            self._notify()

        self._loop.call_soon_threadsafe(apply)

    def request_cancel(self, reason: str) -> None:
        """Stop the job (every worker), write the summary; from the loop's thread (a signal handler)."""
        self.job.cancel_requested = reason
        self._notify()

    def _persist(self) -> None:
        """What a requeued job needs (restart.json): the newest copy, nodes never to use again, faults fired."""
        self.record.persist(self.bad_nodes, self.job.faults_done, self.launcher.batch_node)

    def restore(self, state: Dict[str, Any]) -> None:
        """Start from a previous run's restart.json (after a requeue)."""
        r = self.record.restore(state)
        self.members.bad_nodes, self.job.faults_done = set(r.excluded_nodes), set(r.faults_done)

    async def _shutdown(self) -> None:
        for w in self.workers.values():
            if w.role != "dead" and w.writer is not None:
                self.control.send(w, Stop().encode())
            elif w.writer is None:  # still starting: it cannot hear a stop
                self.launcher.kill_worker(w.wid)
        self.control.close_relays()  # the stops leave now, then each relay passes them on and exits: its node's step can end
        await self.launcher.shutdown(self.cfg.cluster.exit_timeout_s)
        self.record.events.close()

    def _finish(self, code: int, status: str, error: Optional[str], final_sha: Optional[str] = None, final: Optional[Dict[str, Any]] = None) -> int:
        self.job.end()
        self.telemetry.progress.close()
        self.record.write_summary(self._summary(code, status, error, final_sha, final))
        self._emit("job_finished", status=status, exit_code=code, error=error)
        return code

    def _summary(self, code: int, status: str, error: Optional[str], final_sha: Optional[str], final: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        r, t, h = self.record, self.telemetry, self.health
        return {
            "job": r.job_id, "status": status, "exit_code": code, "error": error,
            "steps_completed": t.steps.last_step or 0, "steps_requested": self.cfg.train.steps,
            "final_state_sha256": final_sha,
            "final": final,  # train.save_final: the model file and the state folder, with their sha256
            "world_size": self.job.world, "generations": self.job.gen + 1,
            **r.timing(t.steps.productive_s),
            "final_loss": t.steps.last_loss,
            "final_metrics": t.last_metrics,  # the task's own, of the last step
            "eval": t.last_eval,  # the last evaluation: {"step", "metrics"}
            "faults": fault_list(self.cfg.fault), "faults_fired": sorted(self.job.faults_done), "excluded_nodes": sorted(self.bad_nodes),
            "recoveries": [x.report() for x in r.recoveries],
            "heartbeat_delay": h.hb_delay.report(),  # the workers' clocks against ours: exact on one machine only
            "coordinator_stalls": {"total_s": round(h.stalls.stalled_s, 3), "worst_s": round(h.stalls.worst_s, 3)},
            "skipped_steps": dict(t.skipped), "saved_state": r.saved, "parallel": self._layout_summary(), "resumed_from": r.resume, "run_dir": r.run_dir,
            "record_errors": r.failures.messages,  # files of the run record that could not be written (record.py)
        }

    def _layout_summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"mode": self.layout.mode, "survives_node_losses": self.layout.survives()}
        if self.layout.sharded:
            done = self.job.g(self.gen).done
            out["copies_bytes_by_rank"] = {str(self.workers[w].rank): m.copies_bytes for w, m in sorted(done.items()) if m.copies_bytes is not None}
            out["copy_costs_by_rank"] = {str(self.workers[w].rank): m.copy_costs for w, m in sorted(done.items()) if m.copy_costs is not None}
        return out
