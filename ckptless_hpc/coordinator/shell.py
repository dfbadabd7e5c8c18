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

from ..config import Shape, global_batch, node_losses
from ..control import messages, wire
from ..control.messages import Stop
from ..control.server import Background, ControlServer, Handlers
from ..faults import faults_from_config
from ..slurm.commands import WAITING, SlurmCommandError
from . import host, scheduler_log
from .health import Health
from .job import Complete, Finish, Inputs, JobMachine, LeaveRecovery, Options as JobOptions, Phase, SaveAndRequeue, StartTraining, StopNonfinite
from .membership import FATAL_AT_STARTUP, RECOVER, Membership, WorkerRec
from .moves import DRAIN, STRAGGLER
from ..rundir import requests
from .planner import by_node, initial_ranks
from .record import RunRecord, log_tail, summary
from .reader import Reader
from .recovery import Abort, Assign, Emit, Exclude, Lose, NewGeneration, Reformed, Release, ReleaseCommands
from .reform import Reformer
from .saving import Saver
from .sharding import Layout
from .tally import Arrivals
from .telemetry import Telemetry
from .wakeup import Wakeup

log = logging.getLogger("ckptless_hpc.coordinator")
COMPANION_POLL_S = 2.0  # cluster.grow=job: how often a pending companion job's state is asked
DRAIN_POLL_S = 5.0  # how often the scheduler is asked which of the job's nodes an administrator drains


class Coordinator:
    def __init__(self, cfg: Any, launcher: Any, job: JobMachine, control: ControlServer, record: RunRecord, health: Health, clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.launcher, self.job, self.control, self.record, self.health, self.clock = cfg, launcher, job, control, record, health, clock
        self.wakeup, self.tasks = Wakeup(), Background()  # tasks: the refills and graces started and not awaited
        self.telemetry = Telemetry(cfg, job.world, lambda: self.members.census(), self._console_log)
        self.saver = Saver(cfg, record, job, job.layout, control, launcher, self._until, self._emit, self._persist, self._off_loop, self._finish)
        self.reformer = Reformer(cfg, job, control, launcher, record, self.telemetry, self._emit)
        self.reader = Reader(
            cfg,
            job,
            record,
            self.telemetry,
            control,
            launcher,
            self._emit,
            self._notify,
            self._persist,
            self._lost,
            lambda: self.tasks.spawn(self._refill()),
            lambda gen: self.tasks.spawn(self._reform_if_unexplained(gen)),
            lambda: self.store_addr,
        )
        control.bind(Handlers(self.reader.on_hello, self.reader.on_message, self._lost, self.reader.welcome, self._emit, lambda: self.job.gen))
        self.store: Any = None
        self.store_addr: Optional[str] = None
        self.address: Optional[str] = None
        self._calls: Optional[ThreadPoolExecutor] = None  # launcher calls that wait for the scheduler
        self._refilling = asyncio.Lock()  # one spare refill at a time (_refill)
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str, launcher: Any, secret: str, job_id: str, clock: Callable[[], float] = time.time) -> "Coordinator":
        c = cfg.cluster
        layout = Layout(cfg)
        job = JobMachine(
            Membership(c.workers_per_node), layout, Shape.of(cfg).world, JobOptions.from_cluster(c, cfg.train.get("stall_timeout_s"), cfg.train.steps), faults_from_config(cfg)
        )
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

    resume = property(lambda self: self.record.resume)  # the copy this job starts from (set on the record: resume_from, a requeue)

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
            self.job.fail(f"worker {rec.wid} on node {rec.node} died during start-up: {reason}\n{log_tail(self.launcher.log_path(rec.wid))}")
        elif kind != RECOVER:
            self._exclude(rec.node, f"spare {rec.wid} failed: {reason}")
            self.tasks.spawn(self._refill())
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

    def _judge(self, now: float) -> None:
        """Once per heartbeat interval: who is silent (lost), who straggles (reported)."""
        self._judge_silence(now)
        slow, cleared = self.health.report_stragglers(self.ranks, self.workers, self._emit)
        if self.cfg.cluster.straggler_action == "replace":
            self._replace_stragglers(slow, cleared)
        self._take_requests()
        if self.job.poll_moves():  # a grow-back or a move due: the main loop plans it at the next boundary
            self._notify()

    def _replace_stragglers(self, slow: Dict[int, float], cleared: List[int]) -> None:
        """cluster.straggler_action=replace: a straggler's node is moved to a spare at the next
        boundary (moves.py: once per rank; it waits for a spare while none is built)."""
        for r, ratio in slow.items():
            rec = self.workers[self.ranks[r]]
            got = self.job.moves.straggler(r, rec.node, ratio, self.health.straggling.size)
            if got is None:
                self._emit("straggler_action", rec, action="kept", reason="moved once already: the slowness went with the rank, not its node")
                continue
            refused = self.job.request_move(rec.node, STRAGGLER, got[1])
            self._emit("straggler_action", rec, action="kept" if refused else "replace", reason=refused or got[1])
            if not refused:
                log.warning("rank %d (node %s) straggles: moving its node to a spare at the next step boundary (cluster.straggler_action=replace)", r, rec.node)
                self._notify()
        for r in cleared:  # no longer slow before it moved: stays
            w = self.ranks.get(r)
            req = self.job.moves.wanted.get(self.workers[w].node) if w else None
            if req is not None and req.kind == STRAGGLER:
                self.job.moves.drop(req.node)
                self._emit("straggler_action", self.workers[w], action="kept", reason="no longer slow before its move")

    async def _poll_drains(self) -> None:
        """Every DRAIN_POLL_S: the job's training nodes an administrator marked DRAIN (scontrol)
        are moved to spares at a step boundary, as ``ckptless-hpc drain`` moves them; once each."""
        seen: set = set()
        while not self.job.stopping:
            await asyncio.sleep(DRAIN_POLL_S)
            m = self.members
            nodes = sorted(m.active_nodes - m.bad_nodes)
            for node in await self._off_loop(self.launcher.drained_nodes, nodes) if nodes else []:
                if node in seen or node in m.bad_nodes:
                    continue
                seen.add(node)
                reason = "the scheduler marked it DRAIN"
                refused = self.job.request_move(node, DRAIN, reason)
                self._emit("drain_requested", node=node, reason=reason, refused=refused, request="scheduler")
                log.warning("node %s is marked DRAIN: %s", node, f"not moved: {refused}" if refused else "its ranks move to a spare at the next step boundary")
                self._notify()

    def _take_requests(self) -> None:
        """``ckptless-hpc drain``'s requests in the run directory (rundir/requests.py): a move each."""
        for req in requests.take(self.record.paths.requests):
            node, reason = str(req.get("node")), str(req.get("reason") or "drained by ckptless-hpc drain")
            refused = req.get("error") or (None if req.get("kind") == DRAIN else f"unknown request {req.get('kind')!r}")
            refused = refused or self.job.request_move(node, DRAIN, reason)
            self._emit("drain_requested", node=node, reason=reason, refused=refused, request=req.get("file"))
            if refused:
                log.warning("drain of node %s refused: %s", node, refused)
            else:
                log.info("drain of node %s requested (%s): its ranks move to a spare at the next step boundary", node, reason)
                self._notify()

    def _judge_silence(self, now: float) -> None:
        # still building (importing torch, building the model on a loaded machine): its
        # process exit is watched; silence is judged once it is built
        for wid, reason in self.health.silent(now, self.members.watched(), self.control.unread):
            self._lost(self.workers[wid], reason)

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

        loop, emit = self._loop, self._emit
        self.store = StoreServer(
            bind, self.control.secret, on_reject=lambda peer, err: loop.call_soon_threadsafe(lambda: emit("connection_rejected", peer=str(peer), error=err, port="store"))
        )
        self.store_addr = f"{bind}:{self.store.port}"

    async def run(self) -> int:
        c = self.cfg.cluster
        self._loop = asyncio.get_running_loop()
        bind = wire.resolve_host(c.bind_host)
        host.raise_fd_limit((c.nodes + c.spare_nodes + c.max_refills) * c.workers_per_node)
        self.address = await self.control.listen(bind, host.listen_backlog())
        self._emit(
            "job_started",
            address=self.address,
            coordinator_pid=os.getpid(),
            host=socket.gethostname(),
            world=self.job.world,
            nodes=c.nodes,
            workers_per_node=c.workers_per_node,
            spare_nodes=c.spare_nodes,
        )
        log.info("coordinator for job %s listening on %s; run dir %s", self.record.job_id, self.address, self.record.run_dir)
        log.info("%s; %s", self.job.layout.describe(), node_losses(self.cfg))
        log.info("%s", global_batch(self.cfg))
        self._emit("layout", mode=self.job.layout.mode, survives_node_losses=self.job.layout.survives(), describe=self.job.layout.describe(), node_losses=node_losses(self.cfg))
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
        watch = asyncio.ensure_future(self.health.watch(self.clock, c.heartbeat_interval_s, lambda: self.job.stopping, self._judge, self._emit))
        echo = asyncio.ensure_future(self.telemetry.console.follow(lambda: self.job.stopping))
        drains = asyncio.ensure_future(self._poll_drains())  # the scheduler's DRAIN state (Slurm; a local launcher answers [])
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
            drains.cancel()
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
            deadline = job.stall.deadline() if job.phase is Phase.TRAINING else None  # a stall wakes no one: its deadline does
            await self._until(job.attention, None if deadline is None else max(0.0, deadline - self.clock()))
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
        self.members.ranks = initial_ranks(by_node((w.wid, w.node) for w in starters))
        self.record.t_train = self.clock()
        step0 = self.resume["step"] if self.resume else 0
        self.reformer.assign(self.ranks, step0, {}, load=self.resume)
        self.record.degraded.reformed(step0, self.record.t_train, len(self.ranks), self.job.world)
        host.settle_gc()
        self._emit("generation_started", world=self.job.world, step=step0, resumed_from=self.resume, ranks={str(r): w for r, w in self.ranks.items()})
        if self.job.vacant:  # cluster.start_nodes: the started nodes train the others' ranks too; nodes to grow with
            log.info("started on %d of %d ranks' processes: the others' ranks are trained by them until nodes come", len(self.ranks), self.job.world)
            self.tasks.spawn(self._refill())

    def _carry_out(self, a: Any) -> None:
        """One of the recovery machine's actions (recovery.py)."""
        if isinstance(a, NewGeneration):
            self.job.adopt(a)
        elif isinstance(a, Exclude):
            self._exclude(a.node, a.why)
        elif isinstance(a, Emit):
            self._emit(a.event, self.workers[a.worker] if a.worker else None, **a.fields)
        elif isinstance(a, Abort):
            self.control.broadcast(a.workers, messages.Abort(a.gen, a.at_step).encode())
        elif isinstance(a, Release):
            for wid in self.members.release(list(a.workers)):  # dead to the job first: their exit is no failure
                rec = self.workers[wid]
                self._emit("worker_released", rec, reason=a.why)
                if rec.writer is not None:
                    self.control.send(rec, Stop().encode())
                else:
                    self.launcher.kill_worker(wid)
        elif isinstance(a, Lose):
            self._lost(self.workers[a.worker], a.why)
        elif isinstance(a, Assign):
            self.reformer.assign(dict(a.ranks), a.step, a.sources, adopted=a.adopted)
        elif isinstance(a, ReleaseCommands):
            self.launcher.release_commands()  # promotion sent (or nothing to promote): now the scancel/scontrol of the failed nodes
        elif isinstance(a, Reformed):
            self.reformer.reformed(a.record, a.plan)
        else:
            raise TypeError(f"unknown recovery action {a!r}")

    async def _refill(self) -> None:
        """Start spare nodes until ``cluster.spare_nodes`` are kept (counted in nodes). One refill
        at a time, so that one asked while another runs counts the nodes that one started."""
        async with self._refilling:
            wanted = self.job.refills()
            for i in range(wanted):
                name = await self._off_loop(self.launcher.free_node)
                if name is None and self.cfg.cluster.grow == "job":
                    name = await self._companion_node(wanted - i)
                if name is None:
                    if self.cfg.cluster.grow != "job":
                        self._emit("refill_skipped", reason="no free node left")
                    return
                await self._start_node(name, "spare")
                self._emit("spare_launched", node=name)

    async def _companion_node(self, wanted: int) -> Optional[str]:
        """``cluster.grow=job``: a node of a companion Slurm job (launch/slurm.py), submitted for
        ``wanted`` nodes unless one is pending or has nodes left, and waited for while it pends
        (the scheduler is asked every ``COMPANION_POLL_S``); None when it ended or gave every node."""
        try:
            job, new = await self._off_loop(self.launcher.companion, wanted)
        except SlurmCommandError as e:
            self._emit("refill_skipped", reason=f"no free node left, and the companion job could not be submitted: {e}")
            return None
        if new:
            self._emit("grow_job_submitted", job=job, nodes=wanted)
        while not self.job.stopping:
            try:
                node, state = await self._off_loop(self.launcher.companion_node)
            except SlurmCommandError as e:
                log.warning("cannot read the companion job %s: %s", job, e)
                node, state = None, "PENDING"
            if node is not None:
                return node
            if state not in WAITING:
                self._emit("refill_skipped", reason=f"no free node left, and companion job {job} is {state}")
                return None
            await asyncio.sleep(COMPANION_POLL_S)
        return None

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
        self.record.write_summary(summary(self.record, code, status, error, final_sha, final, self.cfg, self.job, self.telemetry, self.health))
        self._emit("job_finished", status=status, exit_code=code, error=error)
        return code
