"""One worker process: a rank of the data-parallel job, or a hot spare waiting for one.

The agent is the worker's control side: it connects, builds its collaborators from the
coordinator's config (:meth:`Agent.build`), and dispatches on the coordinator's messages. The
training itself (model, optimizer, scheduler, scaler, data, the step, the state's pieces) is the
engine's (:mod:`ckptless_hpc.train`); the agent only calls its methods. Its collaborators:
:mod:`.steps` (a generation's steps), :mod:`.peer_state` (fetching a step's state from peers,
parameters first, and serving it), :mod:`.storage` (the emergency copy), :mod:`.interrupt` (the
waiter: waits the coordinator can cut short), :mod:`.groups` (a generation's process group),
:mod:`.injector` (injected faults), :mod:`.shard_copies` (sharded modes' copies),
:mod:`.periodic` (copies on a schedule), :mod:`.last_resort` (a headless job).

Lifecycle: import torch, connect and authenticate to the coordinator, receive the config,
build the engine (spares too: promotion costs no process start), then obey
the coordinator: ``assign`` (join generation g as rank r at step s, fetching the state from a
peer first when this process does not hold step s), ``abort`` (abandon the in-flight step and
report the committed step held), ``stop``.

Bitwise reproducibility: gradients are reduced in fixed buckets in a fixed order, the global
RNG and the data generator are re-seeded from (seed, step, rank, micro-batch), the LR is a
function of the step (or carried scheduler state), and ``train.threads`` fixes the intra-op
thread count.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import faults as faultlib
from ..config import Shape
from ..control import messages as m
from ..control.client import ControlClient, exit_now
from ..rundir.numbering import shrunk
from ..state.snapshot import state_nbytes
from ..state.transfer import Arena, StateServer, TransferError
from ..tasks.selfcheck import check_batch_determinism
from ..train import cuda
from ..train.comm import resources
from ..train.engine import Engine
from . import last_resort
from .dcp_copies import WRITER
from .exits import EXIT_COORDINATOR_LOST, EXIT_STARTUP_ERROR, EXIT_WORKER_FAILED
from .groups import Groups
from .injector import FaultInjector
from .interrupt import Aborted, CollectiveError, Waiter
from .peer_state import PeerState
from .periodic import PeriodicCopies
from .shard_copies import ShardCopies
from .standing import Standing
from .steps import Steps
from .storage import StorageCopy

log = logging.getLogger("ckptless_hpc.worker")

ORPHANED_SPARE_WAIT_S = 10.0  # a rank claims the last-resort lock at once; a spare acts only if none did


class _Orphaned:
    """Queued behind the coordinator's messages when it is gone (Slurm): the main thread's turn
    to run the last resort. Not a message: nothing sends it."""


ORPHANED = _Orphaned()
# taken by the control reader thread as they arrive (a main thread blocked in a collective is woken)
ON_ARRIVAL = {c.TYPE: c for c in (m.FaultAck, m.Abort, m.Stop, m.CopyAt, m.Dropped)}


@dataclass(frozen=True)
class Address:
    """Who this worker is and how it reaches its coordinator (the command line's)."""

    node: str
    local_index: int
    coordinator: str  # HOST:PORT of the coordinator's control server
    host: str  # the address this worker binds and advertises
    secret: str
    relay: Optional[str] = None  # the node's relay socket (cluster.control=node), else None: straight to the coordinator

    @property
    def name(self) -> str:
        return f"{self.node}.{self.local_index}"


@dataclass
class JobInfo:
    """What the coordinator's ``config`` message says of the job besides the config."""

    run_dir: Optional[str] = None
    on_slurm: bool = False  # a Slurm job: saved and requeued when its coordinator is gone
    spare: bool = False  # started as a hot spare


class Agent:
    """The worker's control side. It holds its collaborators and dispatches the coordinator's
    messages to them; what it knows of the job is its standing (standing.py), and the engine is
    only ever called through its methods. The collaborators that need the coordinator's config
    are built by :meth:`build`, once, right after the connection; before it they are None."""

    def __init__(self, me: Address) -> None:
        self.me = me
        self.standing = Standing(me.node)
        self.waiter = Waiter()
        self.job = JobInfo()
        self.client: Optional[ControlClient] = None
        self.faults: Optional[FaultInjector] = None
        # built from the coordinator's config (build())
        self.cfg: Any = None
        self.engine: Optional[Engine] = None
        self.shards: Optional[ShardCopies] = None  # parallel=zero|fsdp|hsdp only
        self.peers: Optional[PeerState] = None
        self.storage: Optional[StorageCopy] = None
        self.periodic: Optional[PeriodicCopies] = None
        self.groups: Optional[Groups] = None
        self.server: Optional[StateServer] = None
        self.steps: Optional[Steps] = None

    @property
    def ctx(self) -> Dict[str, Any]:
        """The fields every log line carries (job, gen, rank, node, step)."""
        return self.standing.ctx

    # ------------------------------------------------------------------ set-up
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.waiter.orphaned and self.standing.rank is not None:  # Slurm may cancel the steps of a headless job: finish the copy first
            log.warning("SIGTERM while writing the last-resort copy: finishing it first (SIGKILL follows after KillWait)")
            return
        exit_now(128 + signum)

    def start(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack in the worker's log, to see where it waits
        self.client = ControlClient.connect(self.me.relay or self.me.coordinator, self.me.secret, on_message=self._on_message, on_lost=self._on_lost)
        self.faults = FaultInjector(self.client, self.standing)
        from ..slurm.env import SlurmEnvironment

        self.client.send(m.Hello(self.me.node, self.me.local_index, os.getpid(), self.me.host, SlurmEnvironment().step_id))
        raw = self.client.next_message(timeout_s=60)
        msg = m.parse(raw, {m.Config.TYPE: m.Config}) if raw is not None else None
        if not isinstance(msg, m.Config):
            log.error("expected the config from the coordinator, got %r", raw)
            exit_now(EXIT_STARTUP_ERROR)
        # only a job of the Slurm backend saves and requeues when its coordinator is gone: a
        # local run inside an salloc also sees SLURM_JOB_ID, and must never requeue that job
        on_slurm = msg.config["cluster"]["backend"] == "slurm" and bool(SlurmEnvironment().job_id)
        self.job = JobInfo(msg.run_dir, on_slurm, bool(msg.spare))
        self.ctx["job"] = msg.job
        # heartbeats start before the (possibly slow) build so that building is not silence
        self.client.heartbeat_fields = self.standing.heartbeat
        self.client.start_heartbeats(float(msg.config["cluster"]["heartbeat_interval_s"]))
        try:
            built = self.build(msg.config, msg.store)
        except Exception:
            tb = traceback.format_exc()
            log.error("start-up failed:\n%s", tb)
            self.client.send(m.StartupError(tb))
            time.sleep(0.2)
            exit_now(EXIT_STARTUP_ERROR)
        self.client.send(built)

    def build(self, config: Dict[str, Any], store_addr: str) -> m.Built:
        """The engine and every collaborator, from the coordinator's config; the ``built`` message."""
        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        cfg = self.cfg = OmegaConf.create(config)
        torch.set_num_threads(cfg.train.threads)
        # gloo reads it when a group is built: lazy = each pair connects on its first use (train/comm.py)
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if cfg.cluster.gloo_lazy_connect else "0"
        device, backend = cuda.prepare(cfg.cluster, self.me.local_index, os.environ, log)
        task = instantiate(cfg.task)
        world = Shape.of(cfg).world
        # data-loader workers fork here: they must not keep the control connection open
        engine = self.engine = Engine(cfg, task, device, world, close_fds=[self.client.fileno()])
        if engine.task_batches:  # a dataset() is indexed by the framework itself
            check_batch_determinism(task, world)
        entries, _ = engine.collect(0)
        state_bytes = state_nbytes(entries) // (world if engine.sharded else 1)
        self.faults.arm(faultlib.faults_from_config(cfg), cfg.cluster.workers_per_node)
        batch_size = getattr(task, "batch_size", None)
        samples = batch_size * engine.micro_batches * world if isinstance(batch_size, int) else None
        self.shards = ShardCopies(cfg, self.me.secret, self.client, self.waiter.wake) if engine.sharded else None
        receiver, landing = (self.shards.keep, self.shards.landing) if self.shards is not None else (None, None)
        self.periodic = PeriodicCopies(cfg, self.job.run_dir, self.client.send, engine.build_model)
        self.peers = PeerState(cfg, engine, self.shards, self.me.secret, self.client, self.waiter, self.faults, self.standing, self.me.node)
        self.storage = StorageCopy(engine, self.client, self.shards, self.standing, self.peers.held_step, self.me.name)
        self.groups = Groups(cfg, engine, store_addr, self.me.secret, self.me.host, device, backend)
        self.steps = Steps(cfg, engine, self.client, self.standing, self.waiter, self.faults, self.peers, self.shards, self.periodic, self.groups, samples)
        self.server = StateServer(self.me.host, self.me.secret, self.peers.provide, describe=f"[{self.me.node}] ", receiver=receiver, landing=landing)
        self.standing.step = 0  # a freshly built model is the state of step 0 on every worker (seeded init)
        if self.job.spare:
            self._warm_up(state_bytes, device)
        log.info("built %s; state %.1f MB; serving state on %s:%d", task.describe(), state_bytes / 1e6, self.me.host, self.server.port)
        return m.Built(self.server.port, state_bytes, engine.n_params, pid=os.getpid(), **engine.layout())

    def _warm_up(self, state_bytes: int, device: torch.device) -> None:
        """An idle spare: FSDP2 pre-warmed (its first real fully_shard is then fast, docs/sharding.md),
        and the memory it will receive its state into pre-faulted, in the background."""
        warm = self.engine.warm_up()
        if warm is not None:
            log.info("pre-warmed FSDP2 in %.2fs (fully_shard %.3fs)", warm["total_s"], warm["fully_shard_s"])
        # model + two optimizer moments (AdamW) + a margin; the rest would land in fresh memory
        peers = self.peers
        threading.Thread(target=lambda: setattr(peers, "arena", Arena(3 * state_bytes + (1 << 20), pinned=device.type == "cuda")), daemon=True).start()

    # ------------------------------------------------------------------ control
    def _on_message(self, raw: Dict[str, Any]) -> None:
        """In the control reader thread, before the message is queued: what must not wait for the main thread."""
        msg = m.parse(raw, ON_ARRIVAL)
        if isinstance(msg, m.FaultAck):
            self.faults.ack(msg.index)
        elif isinstance(msg, m.Abort) and msg.at_step is not None:  # a planned move: hold at that step, abandon nothing before it
            self.waiter.hold_at(msg.gen, msg.at_step)
        elif isinstance(msg, m.Abort):
            self.waiter.abort(msg.gen)
        elif isinstance(msg, m.Stop):
            self.waiter.stop()
        elif isinstance(msg, m.CopyAt):  # train.save_every_s: a copy of that step (worker/periodic.py)
            self.periodic.ask(msg.step)
        elif isinstance(msg, m.Dropped) and not self.waiter.stopping:  # declared failed: its rank is replaced
            log.error("the coordinator declared this worker failed (%s): exiting without a copy or a requeue", str(msg.why)[:300])
            exit_now(EXIT_COORDINATOR_LOST)

    def _on_lost(self, why: str) -> None:
        if self.waiter.stopping:
            WRITER.finish()  # a relay that passed the stop on is gone: the DCP checkpoints being written end first
            exit_now(0)
        if self.waiter.orphaned:
            return
        if self.job.on_slurm and self.job.run_dir:
            # Slurm keeps a --no-kill job running after its batch host died: stop training at a
            # committed step, and let one rank save the state and requeue the job; a hot spare
            # (no trained state) requeues only if no rank is left to do it
            if self.standing.rank is not None and self.standing.step is not None:
                log.error("lost the coordinator (%s): unless it still answers, writing the last-resort copy, then requeueing", why)
            else:
                log.error("lost the coordinator (%s): a hot spare; waiting %.0f s for a rank to save and requeue", why, ORPHANED_SPARE_WAIT_S)
            self.waiter.orphan(why)
            self.client.inbox.put(ORPHANED)
            return
        log.error("lost the coordinator (%s); exiting: a worker never outlives its coordinator", why)
        exit_now(EXIT_COORDINATOR_LOST)

    def _last_resort(self) -> None:
        """Coordinator gone on Slurm: save once and requeue (worker/last_resort.py); then exit."""
        if last_resort.coordinator_alive(self.me.coordinator, self.me.secret, self.me.name):
            log.error("the coordinator at %s is alive and dropped this worker (declared failed): exiting without a copy or a requeue", self.me.coordinator)
            exit_now(EXIT_COORDINATOR_LOST)
        # a sharded rank's state is one shard of many: it requeues from the last complete copy, as a spare does
        rank = None if self.shards is not None else self.standing.rank
        last_resort.run(
            self.job.run_dir,
            self.me.node,
            rank,
            self.peers.held_step(),
            self.faults.done,
            self.cfg.cluster.max_requeues,
            self.storage.save,
            spare_wait_s=ORPHANED_SPARE_WAIT_S,
            site_exclude=list(self.cfg.cluster.exclude or ()),
        )
        exit_now(EXIT_COORDINATOR_LOST)

    def _handlers(self) -> Dict[type, Callable[[Any], None]]:
        """The main thread's handler of each message class (copy_at and fault_ack are taken on arrival: _on_message)."""
        return {
            m.Assign: self._on_assign,
            m.Abort: self._on_abort,
            m.CopyAt: lambda msg: None,
            m.FaultAck: lambda msg: None,
            m.Inject: lambda msg: self.faults.fire_index(msg.index, self.standing.step),
            m.Stop: lambda msg: self.storage.stop(msg.save),
            m.Save: lambda msg: self.storage.save_shard(msg.path, msg.shard, msg.step),
            m.Export: lambda msg: self.storage.export(msg.files, msg.out, msg.step),
        }

    def serve_forever(self) -> None:
        handlers = self._handlers()
        while True:
            raw = self.client.next_message()
            if raw is ORPHANED:
                self._last_resort()
                continue
            msg = m.parse(raw, m.TO_WORKER)
            handler = handlers.get(type(msg))
            if handler is None:
                log.warning("ignoring unknown message %r", raw["type"])
                continue
            try:
                handler(msg)
            except Exception:  # its own error (a bug, a model its mode cannot carry): the job's error, not a loss
                self._fail(msg)

    def _fail(self, msg: Any) -> None:
        s = self.standing
        during = f"rank {s.rank}, generation {s.gen}, step {s.step}, handling {msg.TYPE}"
        tb = traceback.format_exc()
        log.error("%s: failed:\n%s", during, tb)
        self.client.send(m.WorkerFailed(tb, during))
        time.sleep(0.2)
        exit_now(EXIT_WORKER_FAILED)

    def _on_abort(self, msg: m.Abort) -> None:
        self.waiter.abort(msg.gen)  # a planned move's hold too: this worker trains no more steps of the older generation
        self.faults.fire_due("recovery", self.standing.step)
        self._send_held(msg.gen, reason=m.HeldReason.ABORT.value)

    def _send_held(self, abort_gen: Optional[int], reason: str, blame: Sequence[str] = ()) -> None:
        held = self.peers.held_step()
        # what it can serve (sharded): shard -> steps (live, snapshots, copies held for peers)
        inventory = {str(k): v for k, v in self.shards.inventory(held).items()} if self.shards is not None else None
        # start failed: the state sources that could not serve it (the coordinator blames them)
        self.client.send(m.Held(self.standing.gen, abort_gen, held, os.getpid(), reason, inventory=inventory, blame=list(blame) or None))

    # ------------------------------------------------------------------ generations
    def _on_assign(self, msg: m.Assign) -> None:
        s, gen = self.standing, msg.gen
        if self.waiter.abort_gen > gen:
            return  # superseded before we got to it; the abort that follows gets our answer
        if msg.rank is None and s.ready_rank is None:
            raise RuntimeError(f"gen {gen}: an assign without a rank, and this worker was never ready as any rank. HINT: this is a coordinator bug; please report it")
        rank = s.ready_rank if msg.rank is None else msg.rank  # no rank: keep the one it was last ready as
        if msg.lost:  # a job that shrank: the live ranks are the group's processes, each training its ranks
            live, holders = shrunk(msg.world, msg.lost)
            p = live.index(rank)
            group, trains = (p, len(live), holders), holders[p]
        else:
            group, trains = (rank, msg.world, None), [rank]
        s.join(gen, rank, msg.world, trains)
        self.faults.done = set(msg.faults_done)
        self.peers.drop_behind()  # a generation that never trained: the parameters alone are no state
        target = msg.step
        self.engine.take_rank(s.rank)
        fetch: Dict[int, Dict[str, Any]] = {}  # ZeRO in a job that shrank: the lost ranks' shards to fetch (or load)
        if self.shards is not None:
            adopted = {int(v): a for v, a in (msg.adopted or {}).items()}
            self.shards.release([v for v in self.shards.owned[1:] if v not in adopted], self.engine, s.step)
            self.engine.hold(trains)
            self.shards.assign(gen, msg.shard, msg.holders or [], msg.holds or [], {v: a["holders"] for v, a in adopted.items()})
            live = s.step
            if s.step != target and self.shards.restore(self.engine, target):
                s.at(target)  # rolled back to its own snapshot: the newest step every shard is held at
            fetch = {v: adopted[v] for v in self.shards.take_over(self.engine, target, live)}
        form_s = self._start_generation(msg, gen, target, group, fetch)
        if form_s is None:
            return
        s.ready_rank = s.rank
        self.client.send(m.Ready(gen, s.rank, os.getpid(), form_s))
        shrunk_to = f" (shrunk: {group[1]} processes; this one trains ranks {s.trains})" if msg.lost else ""
        log.info("generation %d formed: rank %d of %d%s at step %d; %s", gen, s.rank, s.world, shrunk_to, s.step, " ".join(f"{k}={v}" for k, v in resources().items()))
        failed = self.steps.run(gen)
        if failed is not None:
            self._send_held(None, reason=failed)  # COLLECTIVE_ERROR + why

    def _start_generation(self, msg: m.Assign, gen: int, target: int, group: Tuple[int, int, Optional[List[List[int]]]], adopted: Dict[int, Dict[str, Any]]) -> Optional[float]:
        """The state of ``target`` (held, loaded or fetched; ``adopted``: the lost ranks' shards to
        fetch, and from where), then the generation's group (its rank, size and who trains which
        ranks); the seconds the formation took, or None when it could not start (reported) or
        was aborted."""
        s, timeout_s = self.standing, self.cfg.cluster.recovery_timeout_s
        try:
            if msg.load and s.step != target:
                self.storage.load(msg.load)
            if s.step != target:
                self.peers.fetch(msg.sources, gen, target, timeout_s)
            for shard, where in adopted.items():
                if where.get("load"):
                    self.storage.load(where["load"], adopted=shard)
                    self.shards.loaded(shard)
                else:
                    self.peers.fetch(where["sources"], gen, target, timeout_s, adopted=shard)
            s.holds_job_state = True  # loaded, fetched, or the fresh init of a job at step 0
            t0 = time.monotonic()
            self.client.send(m.Joining(gen, s.step))
            self.groups.comm = self.waiter.run(lambda: self.groups.form(gen, *group), gen, timeout_s, "form-group")
            self.engine.bind(self.groups.comm)
            if self.shards is not None:  # after the bind: a promoted FSDP spare holds its shard only once sharded
                self.shards.start_generation(self.engine, target)
        except Aborted:
            return None
        except (CollectiveError, TransferError) as e:
            log.error("generation %d could not start: %s", gen, e)
            self._send_held(None, reason=m.held_reason(m.START_FAILED, e), blame=getattr(e, "sources", ()))
            return None
        return time.monotonic() - t0
