"""What workers say, read: each message of a connected worker (control/messages.py's classes)
goes to the job machine (job.py), the run record (record.py) or the telemetry (telemetry.py);
the few things it asks of the shell are callbacks. Decisions are the job machine's."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from omegaconf import OmegaConf

from ..control import messages
from ..control.messages import (
    Built,
    Config,
    CopyAt,
    Done,
    Eval,
    Exported,
    ExportFailed,
    FaultAck,
    FaultFired,
    Fetched,
    Held,
    Inject,
    Joining,
    LoadFailed,
    Metrics,
    NonFinite,
    PeriodicFailed,
    PeriodicSaved,
    Ready,
    Saved,
    SaveFailed,
    StartupError,
    TransferFailed,
    WorkerFailed,
)
from .membership import WorkerRec

log = logging.getLogger("ckptless_hpc.coordinator")


class Reader:
    """``lost(rec, why)``, ``refill()``, ``reform_later(gen)``, ``persist()``, ``notify()``,
    ``emit(event, rec, **fields)``: the shell's; ``store_addr()``: the store's address, once it is up."""

    def __init__(
        self,
        cfg: Any,
        job: Any,
        record: Any,
        telemetry: Any,
        control: Any,
        launcher: Any,
        emit: Callable[..., Any],
        notify: Callable[[], None],
        persist: Callable[[], None],
        lost: Callable[[WorkerRec, str], None],
        refill: Callable[[], None],
        reform_later: Callable[[int], None],
        store_addr: Callable[[], Optional[str]],
    ) -> None:
        self.cfg, self.job, self.record, self.telemetry, self.control, self.launcher = cfg, job, record, telemetry, control, launcher
        self.emit, self.notify, self.persist, self.lost, self.refill, self.reform_later, self.store_addr = emit, notify, persist, lost, refill, reform_later, store_addr
        self._config: Optional[Dict[str, Any]] = None  # the resolved config every worker is sent: resolved once, not once per connection

    def on_hello(self, rec: WorkerRec, hello: Dict[str, Any], relayed: bool) -> None:
        self.launcher.register(rec.wid, hello)
        self.emit("worker_connected", rec, pid=rec.pid, slurm_step=hello.get("slurm_step"), relayed=relayed or None)

    def welcome(self, rec: WorkerRec) -> Dict[str, Any]:
        if self._config is None:
            self._config = OmegaConf.to_container(self.cfg, resolve=True)
        return Config(self.record.job_id, self._config, self.store_addr(), self.record.run_dir, rec.role == "spare").encode()

    def on_message(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        try:
            self.dispatch(rec, msg)
        except (KeyError, ValueError, TypeError) as e:
            log.error(
                "gen=%s rank=%s node=%s: malformed %r message from %s (%s: %s); closing its connection",
                self.job.gen,
                rec.rank,
                rec.node,
                msg.get("type"),
                rec.wid,
                type(e).__name__,
                e,
            )
            self.lost(rec, f"malformed {msg.get('type')!r} message ({type(e).__name__}: {e})")
        self.notify()

    def dispatch(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        m = messages.parse(msg)
        if m is None:
            log.warning("unknown message %r from %s", msg.get("type"), rec.wid)
        elif isinstance(m, Built):
            rec.built, rec.state_port = True, m.state_port
            self.emit(
                "spare_ready" if rec.role == "spare" else "worker_ready",
                rec,
                state_bytes=m.state_bytes,
                params=m.params,
                state_port=m.state_port,
                buckets=m.buckets,
                buffers=m.buffers,
            )
        elif isinstance(m, Metrics):
            self._metrics(rec, m)
        elif isinstance(m, Eval):
            self.emit("eval", rec, step=m.step, metrics=m.metrics, eval_s=m.eval_s)
            self.telemetry.eval(m)
        elif isinstance(m, Held):
            self._held(rec, m)
        elif isinstance(m, (Ready, Joining, Fetched)):
            if isinstance(m, Ready) and m.rank is not None:
                rec.ready_rank = m.rank
            if self.job.recovery is not None:
                self.job.recovery.on_message(rec.wid, m)
            if isinstance(m, Fetched):
                self.emit("state_transferred", rec, source=m.source, bytes=m.bytes, seconds=m.seconds)
        elif isinstance(m, TransferFailed):
            self.emit("transfer_error", rec, source=m.source, error=m.error)
        elif isinstance(m, FaultFired):
            self.control.send(rec, FaultAck(m.index).encode())  # recorded: the worker may now fire it
            ev = self.emit("fault_injected", rec, step=m.step, kind=m.kind, index=m.index, pid=m.pid)
            self.job.fault_fired(m.index, m.kind, ev["time"])  # a kill's recovery has this event's time as its t_fail
            self.persist()
        elif isinstance(m, Done):
            self.job.g(m.gen).done[rec.wid] = m
        else:
            self._outcome(rec, m)

    def _held(self, rec: WorkerRec, m: Held) -> None:
        kind = self.job.held(rec.wid, rec.role, m)
        if kind == "start_failed":
            self.emit("start_failed", rec, step=m.step, reason=m.reason)
            self.notify()
        elif kind == "collective_error":
            log.info("rank %s reported: %s", rec.rank, str(m.reason)[:160])
            self.emit("collective_error", rec, step=m.step, reason=m.reason)
            self.reform_later(self.job.gen)

    def _metrics(self, rec: WorkerRec, m: Metrics) -> None:
        now = self.record.clock()
        self.job.stall.committed(m.step, now, m.step_s)
        self.job.committed(m.step, m.step_s)  # a planned move's boundary counts from here
        back = self.telemetry.step(m, now)
        extra = {"metrics": m.metrics} if m.metrics else {}
        self.emit("step", rec, step=m.step, loss=m.loss, lr=m.lr, grad_norm=m.grad_norm, step_s=m.step_s, skipped=m.skipped, at=now, **extra)
        doomed = self.job.spare_fault(m.step)
        if doomed is not None:
            self.control.send(self.job.members.workers[doomed[1]], Inject(doomed[0]).encode())
        ahead = self.record.copies.timed(now, m.step, float(self.cfg.train.get("save_every_s", 0.0)))
        if ahead is not None:  # train.save_every_s: every rank copies that step (worker/periodic.py)
            self.control.broadcast(self.job.members.ranks.values(), CopyAt(ahead).encode())
        if back is not None:
            if back.refills:
                self.refill()
            rep = back.recovery.report()
            planned = rep.get("planned")
            if planned and not planned.get("called_off"):  # a planned move, shown apart from recoveries
                self.emit(
                    "moved",
                    rec,
                    step=m.step,
                    downtime_s=rep["downtime_s"],
                    kind=planned["kind"],
                    planned_step=planned["step"],
                    nodes=rep["failed_nodes"],
                    ranks=rep["failed_ranks"],
                    reason=planned["reason"],
                    at=now,
                )
            else:
                self.emit("resumed", rec, step=m.step, downtime_s=rep["downtime_s"], at=now)
            self.telemetry.resumed(m.step, rep)
        self.telemetry.show(m, now, self.record.t_train, len(self.record.recoveries), self.job.gen)

    def _outcome(self, rec: WorkerRec, m: Any) -> None:
        """Messages that end the job one way or another: saved, non-finite, start-up error."""
        r = self.record
        if isinstance(m, Saved) and m.shard is not None:  # one shard of a sharded emergency copy
            r.shard_saves[m.shard] = {"path": m.path, "step": m.step, "sha256": m.sha256}
            self.emit("state_saved", rec, step=m.step, path=m.path, shard=m.shard)
        elif isinstance(m, Saved):
            r.saved = {"path": m.path, "step": m.step, "sha256": m.sha256, "bytes": m.bytes, "written": m.written is not False}
            self.emit("state_saved" if m.written is not False else "state_kept", rec, step=m.step, path=m.path, bytes=m.bytes)
        elif isinstance(m, SaveFailed):
            r.save_error = m.error
            self.emit("save_failed", rec, step=m.step, path=m.path, error=m.error)
        elif isinstance(m, PeriodicSaved):
            copy = r.copies.add(m)
            if copy is not None:
                self.emit("state_saved", rec, step=m.step, path=copy["path"], periodic=True)
                self.persist()
        elif isinstance(m, PeriodicFailed):
            self.emit("save_failed", rec, step=m.step, path=m.path, error=m.error, periodic=True)
        elif isinstance(m, Exported):
            r.final = {"model": m.model, "state": m.state, "step": m.step}
            self.emit("final_saved", rec, step=m.step, model=m.model["path"], sha256=m.model["sha256"], state=m.state["path"])
        elif isinstance(m, ExportFailed):
            r.final = {"error": m.error}
            self.emit("save_failed", rec, path=m.path, error=m.error)
        elif isinstance(m, LoadFailed):
            self.job.fail(f"the requeued job cannot resume: {m.error}")
            self.emit("load_failed", rec, path=m.path, error=m.error)
        elif isinstance(m, NonFinite):
            if self.job.nonfinite is None:
                self.job.nonfinite = {
                    "step": m.step,
                    "loss": m.loss,
                    "grad_norm": m.grad_norm,
                    "rank": m.rank,
                    "held": m.held,
                    "worker": rec.wid,
                    "node": rec.node,
                    "skipped": m.skipped,
                }
                self.emit("nonfinite", rec, step=m.step, loss=m.loss, grad_norm=m.grad_norm)
        elif isinstance(m, StartupError):
            self.job.fatal = f"worker {rec.wid} on node {rec.node} failed at start-up:\n{m.traceback.rstrip()}"
        elif isinstance(m, WorkerFailed):
            self.job.fail(f"worker {rec.wid} on node {rec.node} ({m.during}) failed:\n{m.traceback.rstrip()}")
