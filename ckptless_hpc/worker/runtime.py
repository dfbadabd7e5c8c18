"""One worker process: a rank of the data-parallel job, or a hot spare waiting for one.

This is the worker's control side; the training itself (model, optimizer, scheduler, scaler,
data, the step, the state's pieces) is the engine's (:mod:`ckptless_hpc.train`). Beside it:
:mod:`.peer_state` (fetching a step's state from peers, parameters first, and serving it),
:mod:`.storage` (the emergency copy), :mod:`.interrupt` (waits the coordinator can cut short),
:mod:`.shard_copies` (sharded modes' copies), :mod:`.last_resort` (a headless job).

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

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import faults as faultlib
from ..control import wire
from ..slurm.commands import cancel_step
from ..slurm.env import SlurmEnvironment
from ..tasks.selfcheck import check_batch_determinism
from ..state.snapshot import state_nbytes, state_sha256
from ..state.fetch import Behind
from ..state.transfer import Arena, StateServer, TransferError
from .shard_copies import ShardCopies
from ..train import cuda
from ..train.comm import Communicator, DeadlineExceeded, Retired, connect_store, resources, within
from ..train.engine import Engine, StepResult
from ..train.evaluation import eval_due
from ..train.fsdp_strategy import StepFailed
from . import last_resort
from ..control.client import ControlClient, exit_now
from .interrupt import Aborted, CollectiveError, Interruptible
from .peer_state import PeerState
from .periodic import PeriodicCopies
from .storage import StorageCopy

log = logging.getLogger("ckptless_hpc.worker")

EXIT_COORDINATOR_LOST = 17
EXIT_STARTUP_ERROR = 18
EXIT_CUDA_POISONED = 19  # a CUDA error poisoned the context: replaced through the spare path
EXIT_WEDGED = 20  # an NCCL abort or a CUDA stream check did not return within cluster.abort_timeout_s
FAULT_ACK_WAIT_S = 5.0  # an injected fault waits this long at most for the coordinator to record it
ORPHANED_SPARE_WAIT_S = 10.0  # a rank claims the last-resort lock at once; a spare acts only if none did


class _Context(logging.Filter):
    """Stamps every log record with job, generation, rank, node and step."""

    def __init__(self, fields: Dict[str, Any]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for k, v in self.fields.items():
            setattr(record, k, v)
        return True


class Worker(Interruptible, PeerState, StorageCopy):
    def __init__(self, node: str, local_index: int, coordinator: str, host: str, secret: str, relay: Optional[str] = None) -> None:
        self.node = node
        self.local_index = local_index
        self.coordinator = coordinator
        self.relay = relay  # the node's relay socket (cluster.control=node), else None: straight to the coordinator
        self.host = host
        self.secret = secret
        self.ctx: Dict[str, Any] = {"job": "-", "gen": "-", "rank": "spare", "node": node, "step": "-"}
        self.gen = -1
        self.rank: Optional[int] = None
        self.ready_rank: Optional[int] = None  # the rank it last said ready as: a rankless assign keeps it
        self.world = 0
        self.step: Optional[int] = None  # committed step of the state held; None = no valid state
        # whether that state is the job's: a spare's freshly built model is step 0 of a fresh
        # init, and becomes the job's state only once assigned at step 0, fetched or loaded
        self.holds_job_state = False
        self.abort_gen = -1
        self.training = False
        self.faults_done: set = set()
        self.comm: Optional[Communicator] = None
        self._retired = Retired()  # past generations' groups and store clients, released once idle
        self._released_before = 0
        self._wake = threading.Event()
        self._fault_acks: set = set()  # fault indices the coordinator has recorded as fired
        self._fault_acked = threading.Condition()
        self._stopping = False
        self._orphaned: Optional[str] = None  # the coordinator is gone (Slurm: save and requeue)
        self.run_dir: Optional[str] = None
        self.on_slurm = False
        self.compute_s: Optional[float] = None  # forward+backward time of the last step (straggler detection)
        self.behind: Optional[Behind] = None  # parameters first: the optimizer state still arriving behind the first step

    # ------------------------------------------------------------------ set-up
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._orphaned and self.rank is not None:  # Slurm may cancel the steps of a headless job: finish the copy first
            log.warning("SIGTERM while writing the last-resort copy: finishing it first (SIGKILL follows after KillWait)")
            return
        exit_now(128 + signum)

    def start(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.client = ControlClient.connect(self.relay or self.coordinator, self.secret, on_message=self._on_message, on_lost=self._on_lost)
        from ..slurm.env import SlurmEnvironment

        hello = {"type": "hello", "node": self.node, "local": self.local_index, "pid": os.getpid(), "host": self.host}
        hello["slurm_step"] = SlurmEnvironment().step_id
        self.client.send(hello)
        msg = self.client.next_message(timeout_s=60)
        if msg is None or msg.get("type") != "config":
            log.error("expected the config from the coordinator, got %r", msg)
            exit_now(EXIT_STARTUP_ERROR)
        self.run_dir = msg.get("run_dir")
        # only a job of the Slurm backend saves and requeues when its coordinator is gone: a
        # local run inside an salloc also sees SLURM_JOB_ID, and must never requeue that job
        self.on_slurm = msg["config"]["cluster"]["backend"] == "slurm" and bool(SlurmEnvironment().job_id)
        self.hot_spare = bool(msg.get("spare"))
        self.ctx["job"] = msg.get("job", "-")
        # heartbeats start before the (possibly slow) build so that building is not silence
        self.client.heartbeat_fields = lambda: {"gen": self.gen, "step": self.step, "training": self.training, "compute_s": self.compute_s}
        self.client.start_heartbeats(float(msg["config"]["cluster"]["heartbeat_interval_s"]))
        try:
            self._build(msg["config"], msg["store"])
        except Exception:
            tb = traceback.format_exc()
            log.error("start-up failed:\n%s", tb)
            self.client.send({"type": "startup_error", "traceback": tb})
            time.sleep(0.2)
            exit_now(EXIT_STARTUP_ERROR)
        self.client.send(
            {
                "type": "built", "state_port": self.server.port, "pid": os.getpid(), "state_bytes": self.state_bytes, "params": self.n_params,
                "buckets": len(self.engine.grads.buckets) if self.engine.grads is not None else 0, "buffers": sum(len(b) for _, b in self.engine.buffers.groups),
            }
        )

    def _build(self, config: Dict[str, Any], store_addr: str) -> None:
        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        self.cfg = OmegaConf.create(config)
        torch.set_num_threads(self.cfg.train.threads)
        # gloo reads it when a group is built: lazy = each pair connects on its first use (train/comm.py)
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if self.cfg.cluster.gloo_lazy_connect else "0"
        self.device, self.backend = cuda.prepare(self.cfg.cluster, self.local_index, os.environ, log)
        self.task = instantiate(self.cfg.task)
        world = self.cfg.cluster.nodes * self.cfg.cluster.workers_per_node
        # data-loader workers fork here: they must not keep the control connection open
        self.engine = Engine(self.cfg, self.task, self.device, world, close_fds=[self.client.fileno()])
        if self.engine.feed.batches.dataset is None:  # a dataset() is indexed by the framework itself
            check_batch_determinism(self.task, world)
        self.n_params = self.engine.n_params
        entries, _ = self.engine.collect(0)
        self.state_bytes = state_nbytes(entries) // (world if self.engine.sharded else 1)
        self.faults = faultlib.faults_from_config(self.cfg)
        batch_size = getattr(self.task, "batch_size", None)
        self.samples = batch_size * self.engine.micro_batches * world if isinstance(batch_size, int) else None
        self.store_addr = store_addr
        self.shards = ShardCopies(self.cfg, self.secret, self.client, self._wake) if self.engine.sharded else None
        receiver = self.shards.keep if self.shards is not None else None
        self.periodic = PeriodicCopies(self.cfg, self.run_dir, self.client.send)
        self.server = StateServer(self.host, self.secret, self._provide, describe=f"[{self.node}] ", receiver=receiver)
        self.step = 0  # a freshly built model is the state of step 0 on every worker (seeded init)
        self.arena: Optional[Arena] = None
        if self.hot_spare and self.engine.fsdp is not None:  # its first real fully_shard is then fast (docs/sharding.md)
            warm = self.engine.fsdp.warm_up()
            log.info("pre-warmed FSDP2 in %.2fs (fully_shard %.3fs)", warm["total_s"], warm["fully_shard_s"])
        if self.hot_spare:  # an idle spare pre-faults the memory it will receive its state into
            # model + two optimizer moments (AdamW) + a margin; the rest would land in fresh memory
            threading.Thread(target=lambda: setattr(self, "arena", Arena(3 * self.state_bytes + (1 << 20), pinned=self.device.type == "cuda")), daemon=True).start()
        log.info("built %s; state %.1f MB; serving state on %s:%d", self.task.describe(), self.state_bytes / 1e6, self.host, self.server.port)

    # ------------------------------------------------------------------ control
    def _on_message(self, msg: Dict[str, Any]) -> None:
        if msg.get("type") == "fault_ack":
            with self._fault_acked:
                self._fault_acks.add(int(msg["index"]))
                self._fault_acked.notify_all()
        elif msg.get("type") == "abort":
            self.abort_gen = max(self.abort_gen, int(msg["gen"]))
            self._wake.set()
        elif msg.get("type") == "stop":
            self._stopping = True
            self._wake.set()
        elif msg.get("type") == "copy_at":  # train.save_every_s: a copy of that step (worker/periodic.py)
            self.periodic.ask(int(msg["step"]))
        elif msg.get("type") == "dropped" and not self._stopping:  # declared failed: its rank is replaced
            log.error("the coordinator declared this worker failed (%s): exiting without a copy or a requeue", str(msg.get("why"))[:300])
            exit_now(EXIT_COORDINATOR_LOST)

    def _on_lost(self, why: str) -> None:
        if self._stopping:
            exit_now(0)
        if self._orphaned:
            return
        if self.on_slurm and self.run_dir:
            # Slurm keeps a --no-kill job running after its batch host died: stop training at a
            # committed step, and let one rank save the state and requeue the job; a hot spare
            # (no trained state) requeues only if no rank is left to do it
            if self.rank is not None and self.step is not None:
                log.error("lost the coordinator (%s): unless it still answers, writing the last-resort copy, then requeueing", why)
            else:
                log.error("lost the coordinator (%s): a hot spare; waiting %.0f s for a rank to save and requeue", why, ORPHANED_SPARE_WAIT_S)
            self._orphaned = why
            self._wake.set()
            self.client.inbox.put({"type": "_orphaned"})
            return
        log.error("lost the coordinator (%s); exiting: a worker never outlives its coordinator", why)
        exit_now(EXIT_COORDINATOR_LOST)

    def _last_resort(self) -> None:
        """Coordinator gone on Slurm: save once and requeue (worker/last_resort.py); then exit."""
        if last_resort.coordinator_alive(self.coordinator, self.secret, f"{self.node}.{self.local_index}"):
            log.error("the coordinator at %s is alive and dropped this worker (declared failed): exiting without a copy or a requeue", self.coordinator)
            exit_now(EXIT_COORDINATOR_LOST)
        # a sharded rank's state is one shard of many: it requeues from the last complete copy, as a spare does
        rank = None if self.shards is not None else self.rank
        last_resort.run(
            self.run_dir, self.node, rank, self.held_step(), self.faults_done, self.cfg.cluster.max_requeues, self._save, spare_wait_s=ORPHANED_SPARE_WAIT_S,
            site_exclude=list(self.cfg.cluster.exclude or ()),
        )
        exit_now(EXIT_COORDINATOR_LOST)

    def serve_forever(self) -> None:
        while True:
            msg = self.client.next_message()
            kind = msg["type"]
            if kind == "_orphaned":
                self._last_resort()
            elif kind == "assign":
                self._on_assign(msg)
            elif kind == "abort":
                self._fire_due("recovery", self.step)
                self._send_held(int(msg["gen"]), reason="abort")
            elif kind in ("copy_at", "fault_ack"):
                pass  # taken on arrival (_on_message)
            elif kind == "inject":
                self._fire(self.faults[int(msg["index"])], self.step)
            elif kind == "stop":
                self._on_stop(msg)
            elif kind == "save":
                self._save_shard(msg["path"], int(msg["shard"]), int(msg["step"]))
            elif kind == "export":
                self._export(msg["files"], msg["out"], int(msg["step"]))
            else:
                log.warning("ignoring unknown message %r", kind)

    def _fire(self, fault: faultlib.Fault, step: Optional[int]) -> None:
        """Tell the coordinator which fault fires (so it is never repeated), and act on ourselves
        once it has recorded it (at most FAULT_ACK_WAIT_S): behind a relay, a kill_node would
        otherwise kill the relay with the report still in it, and a replacement would fire the
        same fault again."""
        self.client.send({"type": "fault", "index": fault.index, "kind": fault.kind, "at": fault.at, "gen": self.gen, "rank": self.rank, "step": step, "pid": os.getpid()})
        with self._fault_acked:
            if not self._fault_acked.wait_for(lambda: fault.index in self._fault_acks, FAULT_ACK_WAIT_S):
                log.warning("the coordinator did not confirm fault %d within %.0fs: firing it anyway", fault.index, FAULT_ACK_WAIT_S)
        log.warning("injecting fault: %s", fault.describe())
        faultlib.fire(fault, SlurmEnvironment(), cancel_step)  # kill_node under Slurm cancels the node's step (faults.py imports no Slurm code)

    def _due(self, at: str, step: Optional[int]) -> Optional[faultlib.Fault]:
        if self.rank is None or step is None:
            return None
        return faultlib.due(self.faults, self.faults_done, self.rank, self.cfg.cluster.workers_per_node, step, at)

    def _fire_due(self, at: str, step: Optional[int]) -> None:
        fault = self._due(at, step)
        if fault is not None:
            self._fire(fault, step)

    def held_step(self) -> Optional[int]:
        """The committed step of the job's state this process holds; None when it holds none (a
        spare that never received it, or one whose optimizer state is still arriving behind its first
        step): such a process is never a source, nor saved."""
        return self.step if self.holds_job_state and self.behind is None else None

    def _send_held(self, abort_gen: Optional[int], reason: str, blame: Sequence[str] = ()) -> None:
        msg = {"type": "held", "gen": self.gen, "abort_gen": abort_gen, "step": self.held_step(), "pid": os.getpid(), "reason": reason}
        if blame:  # start failed: the state sources that could not serve it (the coordinator blames them)
            msg["blame"] = list(blame)
        if self.shards is not None:  # what it can serve: shard -> steps (live, snapshots, copies held for peers)
            msg["inventory"] = {str(k): v for k, v in self.shards.inventory(self.held_step()).items()}
        self.client.send(msg)

    # ------------------------------------------------------------------ generations
    def _on_assign(self, msg: Dict[str, Any]) -> None:
        gen = int(msg["gen"])
        if self.abort_gen > gen:
            return  # superseded before we got to it; the abort that follows gets our answer
        if msg.get("rank") is None and self.ready_rank is None:
            raise RuntimeError(f"gen {gen}: an assign without a rank, and this worker was never ready as any rank. HINT: this is a coordinator bug; please report it")
        rank = self.ready_rank if msg.get("rank") is None else int(msg["rank"])  # none: keep the rank it was last ready as
        self.gen, self.rank, self.world = gen, rank, int(msg["world"])
        self.faults_done = set(msg.get("faults_done", []))
        self.ctx.update(gen=gen, rank=self.rank)
        self._drop_behind()  # a generation that never trained: the parameters alone are no state
        target = int(msg["step"])
        timeout_s = self.cfg.cluster.recovery_timeout_s
        self.engine.take_rank(self.rank)
        if self.shards is not None:
            self.shards.assign(gen, msg)
            if self.step != target and self.shards.restore(self.engine, target):
                self.step = target  # rolled back to its own snapshot: the newest step every shard is held at
                self.ctx["step"] = target
        try:
            if msg.get("load") and self.step != target:
                self._load(msg["load"])
            if self.step != target:
                self._fetch(msg.get("sources", []), gen, target, timeout_s)
            self.holds_job_state = True  # loaded, fetched, or the fresh init of a job at step 0
            t0 = time.monotonic()
            self.client.send({"type": "joining", "gen": gen, "step": self.step})
            self.comm = self._interruptible(lambda: self._form(gen), gen, timeout_s, "form-group")
            self.engine.bind(self.comm)
            if self.shards is not None:  # after the bind: a promoted FSDP spare holds its shard only once sharded
                self.shards.start_generation(self.engine, target)
        except Aborted:
            return
        except (CollectiveError, TransferError) as e:
            log.error("generation %d could not start: %s", gen, e)
            self._send_held(None, reason=f"start failed: {e}", blame=getattr(e, "sources", ()))
            return
        self.ready_rank = self.rank
        self.client.send({"type": "ready", "gen": gen, "rank": self.rank, "pid": os.getpid(), "form_s": time.monotonic() - t0})
        log.info("generation %d formed: rank %d of %d at step %d; %s", gen, self.rank, self.world, self.step, " ".join(f"{k}={v}" for k, v in resources().items()))
        self._train(gen)

    def _form(self, gen: int) -> Communicator:
        """Generation ``gen``'s group, on a store client of its own (an abandoned formation may
        block its client forever); both are retired with the generation."""
        self._retired.forming(gen, True)
        try:
            host, _, port = self.store_addr.rpartition(":")
            store = connect_store(host, int(port), self.secret, self.cfg.cluster.recovery_timeout_s)
            self._retired.keep(gen, store)
            comm = Communicator.form(store, gen, self.rank, self.world, self.host, self.cfg.cluster.collective_timeout_s, self.device, self.backend)
            if self.engine.mode == "hsdp":  # the shard and replicate groups of this generation (train/fsdp.py)
                from ..train.fsdp import form_hsdp_groups

                p = self.cfg.parallel
                comm.hsdp = form_hsdp_groups(store, gen, self.rank, self.world, int(p.shard_size), self.host, self.cfg.cluster.collective_timeout_s, self.device, self.backend)
            return comm
        finally:
            self._retired.forming(gen, False)

    def _abandon_group(self) -> None:
        """Let go of the generation's group after a failed or abandoned step: NCCL's is aborted and
        the CUDA stream checked, each under cluster.abort_timeout_s; a process where either does
        not return is lost, and exits to be replaced by a spare."""
        comm, self.comm = self.comm, None
        if comm is None:
            return
        deadline = self.cfg.cluster.abort_timeout_s
        try:
            comm.release(deadline)
            if self.engine.fsdp is not None:  # destroyed at once: a peer blocked with us in a group that did not fail here is released only then
                from ..train.fsdp import release_in_background

                release_in_background(self.engine.release(comm))
            else:
                self._retired.keep(comm.gen, comm)
            if self.device.type == "cuda":
                within(lambda: torch.cuda.synchronize(self.device), deadline, "CUDA stream check")
        except DeadlineExceeded as e:
            log.error("%s: this process cannot take part any more; exiting to be replaced by a spare", e)
            exit_now(EXIT_WEDGED)
        except Exception as e:  # noqa: BLE001 - a broken context is not recovered in place
            if cuda.poisons_context(e):
                log.error("CUDA error while releasing generation %d: %s; exiting to be replaced by a spare", comm.gen, e)
                exit_now(EXIT_CUDA_POISONED)
            log.warning("releasing generation %d: %s", comm.gen, e)

    # ------------------------------------------------------------------ training
    def _train(self, gen: int) -> None:
        steps = self.cfg.train.steps
        self.training = True
        try:
            while True:
                if self.abort_gen > gen or self._stopping or self._orphaned:
                    self._drop_behind()
                    self._abandon_group()
                    return
                if eval_due(self.step, int(self.cfg.train.eval_every), steps):  # redone by a generation that starts here
                    self._evaluate(gen)
                if self.step >= steps:
                    break
                if not self._one_step(gen):
                    return
        except Aborted:
            self._drop_behind()
            self._abandon_group()
            return
        except (CollectiveError, StepFailed) as e:
            self._drop_behind()
            self._abandon_group()
            log.warning("collective failed at step %d: %s", self.step, e)
            self.training = False
            self._send_held(None, reason=f"collective error: {e}")
            return
        except Exception as e:
            if cuda.poisons_context(e):  # never "recovered" in place: the spare path replaces this process
                log.error("CUDA error at step %d poisons this process: %s; exiting to be replaced by a spare", self.step, e)
                exit_now(EXIT_CUDA_POISONED)
            raise
        finally:
            self.training = False
        entries, meta = self.engine.collect(self.step)
        done = {"type": "done", "gen": gen, "rank": self.rank, "step": self.step, "sha256": state_sha256(entries, meta)}
        if self.shards is not None:
            done["shard"] = self.shards.shard
            done["copies_bytes"] = self.shards.store.nbytes()  # host memory its snapshots and held copies take
            done["copy_costs"] = self.shards.costs()  # its waits for acks, snapshots, bytes sent (bench B8)
        self.client.send(done)

    def _one_step(self, gen: int) -> bool:
        """One step; False when it was refused (non-finite, train.on_nonfinite=stop)."""
        step = self.step
        t0 = time.perf_counter()
        if self.behind is not None:
            self._start_behind(step)
        res = self.engine.step(step, lambda: self._after_backward(step, t0), lambda futures: self._wait(futures, gen, step))
        if not res.committed:
            self._report_nonfinite(gen, step, res)
            return False
        self._fire_due("update", step)  # right after the optimizer update: before the step is counted or copied
        if res.skipped:
            log.warning("step %d skipped (%s): loss %s, grad norm %s", step, res.skipped, res.loss, res.grad_norm)
        self.step = step + 1
        self.ctx["step"] = self.step
        if self.shards is not None:
            self.shards.committed(self.engine, self.step)
        self.periodic.after_commit(self.step, self.rank, self.shards.shard if self.shards is not None else 0, self.engine.collect)
        if gen > self._released_before:  # this generation works: what the older ones left can go
            self._released_before = gen
            self._retired.release_before(gen)
        if self.rank == 0:
            self.client.send(
                {
                    "type": "metrics", "gen": gen, "step": self.step, "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm,
                    "step_s": time.perf_counter() - t0, "samples": self.samples, "skipped": res.skipped, "skipped_total": dict(self.engine.skipped),
                    "metrics": res.metrics or None,
                }
            )
        return True

    def _evaluate(self, gen: int) -> None:
        """The evaluation after ``self.step`` committed steps (a failure in it is a step's: the
        generation that recovers starts at this step and evaluates again)."""
        step, t0 = self.step, time.perf_counter()
        values = self.engine.evaluate(step, lambda futures: self._wait(futures, gen, step), lambda: self._fire_due("eval", step))
        if self.rank == 0:
            self.client.send({"type": "eval", "gen": gen, "step": step, "metrics": values, "eval_s": time.perf_counter() - t0})

    def _report_nonfinite(self, gen: int, step: int, res: StepResult) -> None:
        what = f"loss {res.loss}" if not math.isfinite(res.loss) else f"gradient norm {res.grad_norm}"
        why = "train.on_nonfinite=stop" if res.over_budget is None else f"train.on_nonfinite=skip has dropped {res.over_budget} steps, train.max_skipped_fraction's limit"
        log.error("step %d: %s is not finite; the state stays at step %d (%s)", step, what, self.step, why)
        self.client.send(
            {"type": "nonfinite", "gen": gen, "rank": self.rank, "step": step, "loss": _num(res.loss), "grad_norm": _num(res.grad_norm), "held": self.step, "skipped": res.over_budget}
        )

    def _after_backward(self, step: int, t0: float) -> None:
        """The injected faults of this step, after its backward and before its collectives land."""
        slow = faultlib.straggler(self.faults, self.rank, step)
        if slow is not None:  # an injected straggler: alive, just slow; reported once, as it starts
            if slow.index not in self.faults_done:
                self.faults_done.add(slow.index)
                self.client.send({"type": "fault", "index": slow.index, "kind": slow.kind, "at": "step", "gen": self.gen, "rank": self.rank, "step": step, "pid": os.getpid()})
            time.sleep((slow.factor - 1) * (time.perf_counter() - t0))
        self.compute_s = time.perf_counter() - t0
        self._fire_due("step", step)
        if self.behind is not None:  # parameters first: the last collective waits for the optimizer state
            self._land_behind(self.gen, step)
        if self.shards is not None:  # the last collective of this step waits for our last copy (shards.py)
            self._await_copy(self.gen, step)

    def _await_copy(self, gen: int, step: int) -> None:
        shards = self.shards
        assert shards is not None
        t0 = time.perf_counter()
        outcome = self._wait_until(shards.copy_confirmed, gen, self.cfg.cluster.collective_timeout_s)
        shards.waited(time.perf_counter() - t0)
        if outcome == "abort":
            raise Aborted("replication")
        if outcome == "timeout":
            raise CollectiveError(f"the copy of step {shards.pending} was not acknowledged by its holders within {self.cfg.cluster.collective_timeout_s}s: {shards.last_error}")

    def _wait(self, futures: List[Any], gen: int, step: int) -> None:
        timeout_s = self.cfg.cluster.collective_timeout_s
        for f in futures:
            f.add_done_callback(lambda _f: self._wake.set())
        outcome = self._wait_until(lambda: all(f.done() for f in futures), gen, timeout_s)
        if outcome == "abort":
            raise Aborted("allreduce")
        if outcome == "timeout":
            raise CollectiveError(f"allreduce at step {step} timed out after {timeout_s}s")
        try:
            for f in futures:
                f.wait()
        except Exception as e:  # gloo raises RuntimeError subclasses on a lost peer
            raise CollectiveError(f"allreduce at step {step}: {e}") from None

def _num(x: float) -> Any:
    """A float for JSON: non-finite values as their names ("nan", "inf")."""
    return x if math.isfinite(x) else str(x)


def _setup_logging(ctx: Dict[str, Any]) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context(ctx))
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s job=%(job)s gen=%(gen)s rank=%(rank)s node=%(node)s step=%(step)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ckptless_hpc.worker", description="ckptless_hpc worker (started by the coordinator)")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator's control server")
    p.add_argument("--node", required=True, help="name of the node this worker runs on")
    p.add_argument("--local-index", default="0", help="index of this worker on its node, or 'slurm' (the task's SLURM_PROCID in its one-node step)")
    p.add_argument("--host", default="auto", help="address this worker binds and advertises; 'auto' = this node's address")
    p.add_argument("--relay", default=None, help="the node's relay socket (cluster.control=node): the control connection goes through it")
    args = p.parse_args(argv)
    if args.local_index == "slurm":
        from ..slurm.env import SlurmEnvironment

        local_index = SlurmEnvironment().procid or 0
    else:
        local_index = int(args.local_index)
    worker = Worker(args.node, local_index, args.coordinator, wire.resolve_host(args.host), wire.load_secret(), relay=args.relay)
    _setup_logging(worker.ctx)
    try:
        worker.start()
        worker.serve_forever()
    except Exception:
        log.error("worker failed:\n%s", traceback.format_exc())
        exit_now(1)
