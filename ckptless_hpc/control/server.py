"""The coordinator's control server: accepting, authenticating and reading worker connections
(direct, or through a node's relay: relay.py), and writing to them. Socket I/O only: what a
message means is its owner's, told through ``Handlers``; the worker records it reads and
writes (``coordinator.membership.WorkerRec``) are its owner's, shared by reference.

Heartbeats, the one message every rank sends every interval, change no decision: they are
read here in place (last seen, compute time, delay) and wake nobody."""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import termios
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Mapping, Optional, Set

from . import wire
from .messages import Dropped
from .relay import DOWN, Batcher, entry

log = logging.getLogger("ckptless_hpc.coordinator")


class Background:
    """Tasks started and not awaited (a welcome once the store is up, a refill, a grace): kept
    until they end, since the event loop keeps only a weak reference to a task."""

    def __init__(self) -> None:
        self._tasks: Set["asyncio.Future[Any]"] = set()

    def spawn(self, coro: Awaitable[Any]) -> "asyncio.Future[Any]":
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


@dataclass(frozen=True)
class Handlers:
    """What the server tells its owner, and the little it asks of it."""

    on_hello: Callable[[Any, Dict[str, Any], bool], None]  # a worker connected (its record, its hello, relayed)
    on_message: Callable[[Any, Dict[str, Any]], None]  # any message but a heartbeat, as read
    on_lost: Callable[[Any, str], None]  # its connection closed (why)
    welcome: Callable[[Any], Dict[str, Any]]  # its first message: the config
    emit: Callable[..., Any]  # an event of the run record (connection_rejected, relay_connected, send_refused)
    gen: Callable[[], int]  # the generation, for log lines


class ControlServer:
    """One per job. ``workers``: wid -> record (writer, reader, outbox, last_seen, ...); the
    heartbeat sinks: ``stalls`` (the coordinator's own stalls), ``straggling`` (compute times),
    ``hb_delay`` (heartbeat sent -> read)."""

    def __init__(
        self, workers: Mapping[str, Any], secret: str, clock: Callable[[], float], stalls: Any, straggling: Any, hb_delay: Any, handlers: Optional[Handlers] = None
    ) -> None:
        self.workers, self.secret, self.clock = workers, secret, clock
        self.on: Handlers = handlers  # type: ignore[assignment]  # bind() where the owner is built after the server
        self.stalls, self.straggling, self.hb_delay = stalls, straggling, hb_delay
        self.relays: Dict[str, RelayLink] = {}  # node -> its relay's link (cluster.control=node)
        self.ready = asyncio.Event()  # set once workers may be welcomed (the store is up)
        self._server: Optional[asyncio.AbstractServer] = None
        self._later = Background()  # relayed workers welcomed once the store is up

    def bind(self, handlers: Handlers) -> None:
        self.on = handlers

    async def listen(self, host: str, backlog: int) -> str:
        """Listen on ``host`` (any free port); the address workers connect to."""
        self._server = await asyncio.start_server(self._handle, host=host, port=0, backlog=backlog)
        return f"{host}:{self._server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            await wire.aserver_handshake(reader, writer, self.secret, timeout_s=5.0)
            hello = await asyncio.wait_for(wire.arecv_msg(reader), 30.0)
            link = self._accept_relay(hello, writer) if hello.get("type") == "relay" else None
            if link is None:
                rec = self._accept_hello(hello, writer)
                await self.ready.wait()
        except (wire.ProtocolError, asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, KeyError, ValueError, TypeError) as e:
            self._reject(peer, e)
            writer.close()
            return
        if link is not None:
            return await self._serve_relay(link, reader, writer)
        # it says nothing more until it has its config: from here on, frames are read as they arrive
        closed: "asyncio.Future[str]" = asyncio.get_running_loop().create_future()
        frames = rec.reader = wire.FrameProtocol(lambda m: self._on_frame(rec, m), lambda why: closed.done() or closed.set_result(why))
        frames.take_over(reader, writer)
        self._welcome(rec)
        why = await closed
        self.on.on_lost(rec, f"control connection closed ({why})")
        writer.close()

    def _reject(self, peer: Any, e: BaseException) -> None:
        why = str(e) or type(e).__name__
        log.warning("rejected a connection from %s: %s", peer, why)
        self.on.emit("connection_rejected", peer=str(peer), error=why)

    def _accept_hello(self, hello: Dict[str, Any], writer: Any) -> Any:
        """A worker says who it is: its record gets the connection (raises ProtocolError if it is
        nobody this job started, or is already connected)."""
        wid = f"{hello.get('node')}.{hello.get('local')}"
        if hello.get("type") != "hello" or wid not in self.workers or self.workers[wid].writer is not None:
            raise wire.ProtocolError(f"unexpected hello {hello!r}")
        rec = self.workers[wid]
        rec.writer, rec.pid, rec.host = writer, int(hello["pid"]), str(hello["host"])
        rec.last_seen, rec.seen_stall = self.clock(), self.stalls.stalled_s
        self.on.on_hello(rec, hello, isinstance(writer, RelayedWriter))
        return rec

    def _welcome(self, rec: Any) -> None:
        """Its config, then what was said to it before it connected."""
        self.send(rec, self.on.welcome(rec))
        for queued in rec.outbox:
            self.send(rec, queued)
        rec.outbox.clear()

    # ------------------------------------------------------------------ a node's relay (relay.py)
    def _accept_relay(self, first: Dict[str, Any], writer: asyncio.StreamWriter) -> "RelayLink":
        node = str(first.get("node"))
        if f"{node}.0" not in self.workers:  # workers are <node>.<local index>
            raise wire.ProtocolError(f"a relay for node {node!r}, which this job did not start")
        if node in self.relays and not self.relays[node].writer.is_closing():
            raise wire.ProtocolError(f"a second relay for node {node!r} while its first is connected")
        self.on.emit("relay_connected", node=node, pid=first.get("pid"), host=first.get("host"))
        link = self.relays[node] = RelayLink(node, writer)
        return link

    def close_relays(self) -> None:
        """The job is over: what was written to the relays goes out, then their connections close."""
        for link in self.relays.values():
            link.flush()
            link.writer.close()

    async def _serve_relay(self, link: "RelayLink", reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        node = link.node
        closed: "asyncio.Future[str]" = asyncio.get_running_loop().create_future()
        link.reader = wire.FrameProtocol(lambda m: self._on_relay_frame(link, m), lambda why: closed.done() or closed.set_result(why))
        link.reader.take_over(reader, writer)
        why = await closed
        for rec in list(link.recs.values()):
            self.on.on_lost(rec, f"the relay connection of node {node} closed ({why})")
        writer.close()

    def _on_relay_frame(self, link: "RelayLink", msg: Dict[str, Any]) -> None:
        kind = msg["type"]
        try:
            if kind == "hbs":
                return self._on_summary(link, msg)
            if kind != "up":
                raise ValueError(f"unexpected {kind!r} frame")
            for wid, m in msg["m"]:
                self._on_relayed(link, str(wid), m)
        except (wire.ProtocolError, KeyError, ValueError, TypeError) as e:
            log.error("gen=%s node=%s: malformed frame from the node's relay (%s: %s); closing it", self.on.gen(), link.node, type(e).__name__, e)
            self.on.emit("connection_rejected", node=link.node, error=f"{type(e).__name__}: {e}", port="relay")
            link.writer.close()

    def _on_relayed(self, link: "RelayLink", wid: str, m: Dict[str, Any]) -> None:
        if m["type"] == "hello":
            return self._relayed_hello(link, wid, m)
        rec = link.recs.get(wid)
        if rec is None:
            return  # dropped already (its last words), or nobody this relay connected
        if m["type"] == "gone":
            del link.recs[wid]
            self.on.on_lost(rec, str(m.get("why")))
        else:
            self._on_frame(rec, m)

    def _relayed_hello(self, link: "RelayLink", wid: str, m: Dict[str, Any]) -> None:
        try:
            if m.get("node") != link.node or wid != f"{m.get('node')}.{m.get('local')}":
                raise wire.ProtocolError(f"node {link.node}'s relay spoke for {wid} as {m.get('node')}.{m.get('local')}")
            rec = self._accept_hello(m, RelayedWriter(link, wid))
        except (wire.ProtocolError, KeyError, ValueError, TypeError) as e:  # that worker is refused, not its node
            self._reject(f"{wid} through node {link.node}'s relay", e)
            link.put(wid, wire.encode_body(Dropped(f"refused: {e}"[:500]).encode()))
            return
        link.recs[wid] = rec
        rec.reader = link.reader
        if self.ready.is_set():
            self._welcome(rec)
        else:
            self._later.spawn(self._welcome_when_ready(rec))

    async def _welcome_when_ready(self, rec: Any) -> None:
        await self.ready.wait()
        if rec.role != "dead":
            self._welcome(rec)

    def _on_summary(self, link: "RelayLink", msg: Dict[str, Any]) -> None:
        """A node's heartbeats, one frame: each worker's age at the relay, its newest step."""
        now = self.clock()
        self.hb_delay.add(now - msg.get("t", now))
        stalled = self.stalls.stalled_s
        recs = link.recs
        for wid, (age, step, compute_s) in msg["w"].items():
            rec = recs.get(wid)
            if rec is None:
                continue
            seen = now - float(age)
            if rec.last_seen is None or seen > rec.last_seen:
                rec.last_seen, rec.seen_stall = seen, stalled
            if step is not None or compute_s is not None:
                self.straggling.add(wid, step, compute_s)

    def _on_frame(self, rec: Any, msg: Dict[str, Any]) -> None:
        now = self.clock()
        rec.last_seen, rec.seen_stall = now, self.stalls.stalled_s
        if msg["type"] == "hb":  # the most frequent message changes no decision: no wake-up
            self.straggling.add(rec.wid, msg.get("step"), msg.get("compute_s"))
            self.hb_delay.add(now - msg.get("t", now))
            return
        self.on.on_message(rec, msg)

    # ------------------------------------------------------------------ writing
    def send(self, rec: Any, msg: Dict[str, Any]) -> None:
        if rec.writer is None:  # still starting (a spare promoted before it connected): keep in order
            rec.outbox.append(msg)
            return
        try:
            frame = wire.encode(msg)
        except wire.ProtocolError as e:  # a bug, not the peer's fault: say so and keep the job alive
            log.error(
                "gen=%s rank=%s node=%s: %s %s not sent: %s. HINT: this is a coordinator bug; please report it", self.on.gen(), rec.rank, rec.node, msg.get("type"), rec.wid, e
            )
            self.on.emit("send_refused", rec, type=msg.get("type"), error=str(e))
            return
        self._write(rec, frame)

    def broadcast(self, wids: Iterable[str], msg: Dict[str, Any]) -> None:
        """The same message to many workers: encoded once; one entry per node's relay."""
        frame = wire.encode(msg)
        relayed: Dict[RelayLink, List[str]] = {}
        for wid in wids:
            rec = self.workers[wid]
            if rec.writer is None:
                rec.outbox.append(msg)
            elif isinstance(rec.writer, RelayedWriter):
                if not rec.writer.is_closing():
                    relayed.setdefault(rec.writer.link, []).append(wid)
            else:
                self._write(rec, frame)
        for link, group in relayed.items():
            link.put(group, frame[4:])

    def drop(self, rec: Any, why: str) -> None:
        """Declared failed: it is told so (it then exits without any last resort), then its
        connection is closed."""
        if rec.writer is None or rec.writer.is_closing():
            return
        if isinstance(rec.writer, RelayedWriter):
            rec.writer.drop(why)
            return
        self._write(rec, wire.encode(Dropped(why[:500]).encode()))
        rec.writer.close()

    def _write(self, rec: Any, frame: bytes) -> None:
        if rec.writer.is_closing():
            return
        try:
            rec.writer.write(frame)
        except (ConnectionError, RuntimeError) as e:
            log.warning("send to %s failed: %s", rec.wid, e)

    def unread(self, wid: str) -> bool:
        """Bytes from this worker wait to be read (buffered or in the kernel): it is not silent."""
        rec = self.workers[wid]
        if rec.reader is not None and rec.reader.pending() > 0:
            return True
        return kernel_unread(rec.writer) > 0


def kernel_unread(writer: Any) -> int:
    """Bytes waiting in a connection's kernel receive buffer (0 when unknown)."""
    sock = writer.get_extra_info("socket") if writer is not None else None
    if sock is None:
        return 0
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        return buf[0]
    except (OSError, ValueError):
        return 0


class RelayLink:
    """One node's relay connection (relay.py): what is written to its workers during one loop
    iteration leaves as one frame."""

    def __init__(self, node: str, writer: asyncio.StreamWriter) -> None:
        self.node, self.writer = node, writer
        self.reader: Any = None
        self.recs: Dict[str, Any] = {}  # the workers connected through it, until gone or dropped
        self._down = Batcher(DOWN, self._write)

    def put(self, target: Any, body: bytes) -> None:
        self._down.put(entry(target, body))

    def flush(self) -> None:
        """Write what waits for the end of this loop iteration now."""
        self._down.flush()

    def _write(self, frame: bytes) -> None:
        if not self.writer.is_closing():
            try:
                self.writer.write(frame)
            except (ConnectionError, RuntimeError) as e:
                log.warning("send to node %s's relay failed: %s", self.node, e)


class RelayedWriter:
    """A relayed worker's connection, where a direct worker has its StreamWriter."""

    def __init__(self, link: RelayLink, wid: str) -> None:
        self.link, self.wid = link, wid
        self._closed = False

    def write(self, frame: bytes) -> None:
        self.link.put(self.wid, frame[4:])  # the message without its length header

    def is_closing(self) -> bool:
        return self._closed or self.link.writer.is_closing()

    def drop(self, why: str) -> None:
        if not self._closed:
            self.link.put(self.wid, wire.encode_body(Dropped(why[:500]).encode()))
            self.link.recs.pop(self.wid, None)
            self._closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.link.writer.get_extra_info(name, default)
