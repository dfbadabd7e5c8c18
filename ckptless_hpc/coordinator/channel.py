"""The coordinator's control channel: accepting, authenticating and reading worker connections,
and writing to them. Socket I/O only: what a message means is decided elsewhere
(``Coordinator._dispatch``, membership.py, detector.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Iterable, Optional

from .. import protocol
from . import host, messages
from .membership import WorkerRec

log = logging.getLogger("ckptless_hpc.coordinator")


class Channel:
    """Mixed into ``Coordinator``: reads frames into ``_on_frame`` and sends its messages."""

    workers: Dict[str, WorkerRec]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        rec: Optional[WorkerRec] = None
        try:
            await protocol.aserver_handshake(reader, writer, self.secret, timeout_s=5.0)
            hello = await asyncio.wait_for(protocol.arecv_msg(reader), 30.0)
            wid = f"{hello.get('node')}.{hello.get('local')}"
            if hello.get("type") != "hello" or wid not in self.workers or self.workers[wid].writer is not None:
                raise protocol.ProtocolError(f"unexpected hello {hello!r}")
            rec = self.workers[wid]
            rec.writer, rec.pid, rec.host = writer, int(hello["pid"]), str(hello["host"])
            rec.last_seen, rec.seen_stall = self.clock(), self.stalls.stalled_s
            self.launcher.register(wid, hello)
            self._emit("worker_connected", rec, pid=rec.pid, slurm_step=hello.get("slurm_step"))
            await self._store_ready.wait()
        except (protocol.ProtocolError, asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, KeyError, ValueError, TypeError) as e:
            why = str(e) or type(e).__name__
            log.warning("rejected a connection from %s: %s", peer, why)
            self._emit("connection_rejected", peer=str(peer), error=why)
            writer.close()
            return
        # it says nothing more until it has its config: from here on, frames are read as they arrive
        closed: "asyncio.Future[str]" = asyncio.get_running_loop().create_future()
        frames = rec.reader = protocol.FrameProtocol(lambda m: self._on_frame(rec, m), lambda why: closed.done() or closed.set_result(why))
        frames.take_over(reader, writer)
        self._send(rec, {"type": "config", "job": self.job_id, "config": self._config_dict(), "store": self.store_addr, "run_dir": self.run_dir, "spare": rec.role == "spare"})
        for queued in rec.outbox:
            self._send(rec, queued)
        rec.outbox.clear()
        why = await closed
        self._lost(rec, f"control connection closed ({why})")
        writer.close()

    def _on_frame(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        now = self.clock()
        rec.last_seen, rec.seen_stall = now, self.stalls.stalled_s
        if msg["type"] == "hb":  # the most frequent message changes no decision: no wake-up
            self.straggling.add(rec.wid, msg.get("step"), msg.get("compute_s"))
            self.hb_delay.add(now - msg.get("t", now))
            return
        try:
            self._dispatch(rec, msg)
        except (KeyError, ValueError, TypeError) as e:
            log.error("gen=%s rank=%s node=%s: malformed %r message from %s (%s: %s); closing its connection", self.gen, rec.rank, rec.node, msg.get("type"), rec.wid, type(e).__name__, e)
            rec.writer.close()
        self._notify()

    def _send(self, rec: WorkerRec, msg: Dict[str, Any]) -> None:
        if rec.writer is None:  # still starting (a spare promoted before it connected): keep in order
            rec.outbox.append(msg)
            return
        try:
            frame = protocol.encode(msg)
        except protocol.ProtocolError as e:  # a bug, not the peer's fault: say so and keep the job alive
            log.error("gen=%s rank=%s node=%s: %s %s not sent: %s. HINT: this is a coordinator bug; please report it", self.gen, rec.rank, rec.node, msg.get("type"), rec.wid, e)
            self._emit("send_refused", rec, type=msg.get("type"), error=str(e))
            return
        self._write(rec, frame)

    def _broadcast(self, wids: Iterable[str], msg: Dict[str, Any]) -> None:
        """The same message to many workers: encoded once."""
        frame = protocol.encode(msg)
        for wid in wids:
            rec = self.workers[wid]
            if rec.writer is None:
                rec.outbox.append(msg)
            else:
                self._write(rec, frame)

    def _write(self, rec: WorkerRec, frame: bytes) -> None:
        if rec.writer.is_closing():
            return
        try:
            rec.writer.write(frame)
        except (ConnectionError, RuntimeError) as e:
            log.warning("send to %s failed: %s", rec.wid, e)

    def _unread(self, wid: str) -> bool:
        """Bytes from this worker wait to be read (buffered or in the kernel): it is not silent."""
        rec = self.workers[wid]
        if rec.reader is not None and rec.reader.pending() > 0:
            return True
        return host.kernel_unread(rec.writer) > 0


class Endpoints:
    """A worker's (host, state port) by id, read on demand: no per-assign copy of all workers."""

    def __init__(self, workers: Dict[str, WorkerRec]) -> None:
        self._w = workers

    def __getitem__(self, wid: str) -> messages.Endpoint:
        w = self._w[wid]
        return w.host, w.state_port

