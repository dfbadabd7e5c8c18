"""A node's relay (``cluster.control=node``): one control connection to the coordinator for all
the workers of a node, instead of one per worker.

At 10,000 ranks the coordinator's cost is frames, not decisions: a heartbeat per rank per
interval, and three frames per rank in a recovery (abort, held, assign). A node's ranks share
its fate, so its relay carries their frames in batches: the coordinator reads one heartbeat
summary per node per interval and writes one frame per node per loop iteration.

The relay is a small asyncio process next to the node's workers (no torch): it connects to
the coordinator (the job's authenticated handshake), then listens on a node-local Unix socket
where the workers connect (the same handshake) and speak the unchanged worker wire.

Wire (each a frame of ``protocol``; the classes of control/messages.py ``RELAY``):

- relay -> coordinator, first: ``{"type": "relay", "node", "pid", "host"}``;
  then ``{"type": "up", "m": [[worker, message], ...]}``: the workers' messages in order, each
  worker's ``hello`` first; ``[worker, {"type": "gone", "why"}]`` when its local connection
  closed (the process died); every interval ``{"type": "hbs", "t", "w": {worker: [age_s,
  step, compute_s]}}``: how long ago each worker was last heard, and its newest heartbeat's
  fields (null when none came since the last summary).
- coordinator -> relay: ``{"type": "down", "m": [[worker or [workers], message], ...]}``; a
  ``{"type": "dropped", "why"}`` message is delivered, then that worker's connection closed.

Failure model: a worker's death costs its rank (the relay reports it ``gone``), as without a
relay; the relay's death or a lost relay connection costs every rank of its node (they share
the node's fate anyway). A relay that loses the coordinator closes its workers' connections:
each then asks the coordinator itself (``worker/last_resort.coordinator_alive``) before any
last resort, as a worker without a relay does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import hashlib
import hmac
import socket
import stat
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from . import messages, wire
from .messages import Down, Dropped, Gone, Heartbeat, Hello, RelayHello, Stop

log = logging.getLogger("ckptless_hpc.control.relay")

Target = Union[str, Sequence[str]]


def socket_path(secret: str, node: str) -> str:
    """The node-local socket of ``node``'s relay (Slurm: worked out by every task of the node's
    step alike): in a directory of its own under the temp dir, named from the job's secret, so
    that another user of the node can neither guess it nor take it first; the relay creates it
    0700 (:func:`private_dir`). Short: a Unix socket path is limited to 107 bytes."""
    digest = hmac.new(secret.encode(), f"relay|{node}".encode(), hashlib.sha256).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), f"ckptless-relay-{digest}", "relay.sock")


class RelayError(RuntimeError):
    """The relay cannot listen where it was told; the message names the path and the fix."""


def private_dir(path: str) -> None:
    """The directory of the socket ``path``: created 0700, or one already there that is this
    user's and private (a launcher's ``mkdtemp``); anything else is refused, never used."""
    d = os.path.dirname(path)
    try:
        os.mkdir(d, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RelayError(
            f"the relay's socket directory {d} exists and is not a private directory of this user "
            f"(owner uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}): the relay does not listen in it. "
            "HINT: remove it; a relay's directory is created by the relay (mode 0700) or by the launcher (mkdtemp)"
        )


UP = messages.UP_HEAD
DOWN = messages.DOWN_HEAD


def batch_frames(head: bytes, entries: List[bytes], max_body: int = wire.MAX_FRAME) -> List[bytes]:
    """``{"type": "up"|"down", "m": [...]}`` frames (``head`` says which) of encoded entries,
    each frame within the limit (an entry holds one message of at most ``MAX_FRAME``, so a
    batch may need a few frames; an entry alone over the limit still leaves, and is refused
    by the reader as any oversized frame is)."""
    frames, part, size = [], [], len(head) + 2
    for e in entries:
        if part and size + len(e) + 1 > max_body:
            frames.append(wire.frame(head + b",".join(part) + b"]}"))
            part, size = [], len(head) + 2
        part.append(e)
        size += len(e) + 1
    if part:
        frames.append(wire.frame(head + b",".join(part) + b"]}"))
    return frames


def entry(target: Target, body: bytes) -> bytes:
    """One ``[worker or [workers], message]`` entry of a batch, from the message's JSON."""
    return b"[" + json.dumps(target if isinstance(target, str) else list(target), separators=(",", ":")).encode() + b"," + body + b"]"


def message_entry(worker: str, msg: Dict[str, Any]) -> bytes:
    """``entry(worker, encode_body(msg))`` in one encoding (the relay forwards every message)."""
    e = json.dumps([worker, msg], separators=(",", ":")).encode()
    if len(e) > wire.MAX_FRAME:
        raise wire.ProtocolError(f"message of {len(e)} bytes exceeds the {wire.MAX_FRAME}-byte frame limit")
    return e


class Batcher:
    """Entries written during one loop iteration leave as one frame (or as few as the limit allows)."""

    def __init__(self, head: bytes, write: Callable[[bytes], None]) -> None:
        self._head, self._write = head, write
        self._entries: List[bytes] = []
        self._due = False

    def put(self, e: bytes) -> None:
        self._entries.append(e)
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._due = False
        entries, self._entries = self._entries, []
        for f in batch_frames(self._head, entries):
            self._write(f)


class Upstream:
    """The relay's connection to the coordinator: forwards its workers' messages in batches,
    sends a heartbeat summary every interval, hands what the coordinator says to ``deliver``.

    ``deliver(workers, message)`` gets each downward message with the workers it is for. Used
    by the relay process and, with simulated workers, by B7 (bench/b7_ranks.py).
    """

    def __init__(self, node: str, interval_s: float, deliver: Callable[[List[str], Dict[str, Any]], None], on_closed: Callable[[str], None]) -> None:
        self.node, self.interval_s = node, interval_s
        self._deliver, self._on_closed = deliver, on_closed
        self.writer: Optional[asyncio.StreamWriter] = None
        self._up: Optional[Batcher] = None
        self._heard: Dict[str, float] = {}  # worker -> when it was last heard (monotonic)
        self._beat: Dict[str, List[Any]] = {}  # worker -> [step, compute_s] of its newest heartbeat since the last summary
        self._summaries: Optional["asyncio.Task[None]"] = None

    async def connect(self, address: str, secret: str, host: str, timeout_s: float = 120.0) -> None:
        h, _, port = address.rpartition(":")
        reader, writer = await wire.aconnect_paced(h, int(port), secret, timeout_s=timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(wire.encode(RelayHello(self.node, os.getpid(), host).encode()))
        self.writer = writer
        self._up = Batcher(UP, self._write)
        frames = wire.FrameProtocol(self._on_frame, self._closed)
        frames.take_over(reader, writer)
        self._summaries = asyncio.ensure_future(self._summary_loop())

    def _write(self, frame: bytes) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(frame)

    def forward(self, worker: str, msg: Dict[str, Any]) -> None:
        """A worker's message: a heartbeat is folded into the next summary, the rest leaves now."""
        if msg.get("type") == Heartbeat.TYPE:  # the hot path: read in place (control/messages.py)
            self._heard[worker] = time.monotonic()
            self._beat[worker] = [msg.get("step"), msg.get("compute_s")]
            return
        self.forward_entry(worker, message_entry(worker, msg))

    def forward_entry(self, worker: str, encoded: bytes) -> None:
        """A message already encoded as its batch entry (``message_entry``), not a heartbeat."""
        self._heard[worker] = time.monotonic()
        if self._up is not None:
            self._up.put(encoded)

    def gone(self, worker: str, why: str) -> None:
        self._heard.pop(worker, None)
        self._beat.pop(worker, None)
        if self._up is not None:
            self._up.put(message_entry(worker, Gone(why).encode()))

    def summary(self, now: float) -> Dict[str, Any]:
        beats, self._beat = self._beat, {}
        w = {wid: [round(now - t, 4), *(beats.get(wid) or (None, None))] for wid, t in self._heard.items()}
        return messages.heartbeat_summary(time.time(), w)

    async def _summary_loop(self) -> None:
        while self.writer is not None and not self.writer.is_closing():
            await asyncio.sleep(self.interval_s)
            if self._heard:
                self._write(wire.encode(self.summary(time.monotonic())))

    def _on_frame(self, msg: Dict[str, Any]) -> None:
        if messages.kind(msg, messages.RELAY) is not Down:
            log.warning("node %s: unexpected %r frame from the coordinator", self.node, msg.get("type"))
            return
        for target, m in msg.get("m", ()):
            self._deliver([target] if isinstance(target, str) else list(target), m)

    def _closed(self, why: str) -> None:
        if self._summaries is not None:
            self._summaries.cancel()
        self._on_closed(why)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Relay:
    """The relay process: the node's workers on a Unix socket, the coordinator upstream."""

    def __init__(self, node: str, coordinator: str, path: str, secret: str, interval_s: float, host: str) -> None:
        self.node, self.coordinator, self.path, self.secret, self.host = node, coordinator, path, secret, host
        self.local: Dict[str, asyncio.StreamWriter] = {}
        self.stopped: set = set()  # workers the coordinator told to stop (the job is over)
        self.up = Upstream(node, interval_s, self._deliver, self._lost_coordinator)
        self.done: "asyncio.Future[str]"

    async def run(self) -> str:
        self.done = asyncio.get_running_loop().create_future()
        private_dir(self.path)  # first: nobody else gets to make it while the coordinator is reached
        await self.up.connect(self.coordinator, self.secret, self.host)
        if os.path.exists(self.path):
            os.unlink(self.path)  # a previous relay's socket (same job and node, in our own directory): ours now
        server = await asyncio.start_unix_server(self._handle, path=self.path)
        os.chmod(self.path, 0o600)
        log.info("node %s: relay for the coordinator at %s, workers at %s", self.node, self.coordinator, self.path)
        try:
            return await self.done
        finally:
            server.close()
            for w in self.local.values():
                w.close()
            for leave in (os.unlink, os.rmdir):  # the socket, then its directory once empty (a launcher's holds other nodes' too)
                try:
                    leave(self.path if leave is os.unlink else os.path.dirname(self.path))
                except OSError:
                    pass

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await wire.aserver_handshake(reader, writer, self.secret, timeout_s=5.0)
            hello = await asyncio.wait_for(wire.arecv_msg(reader), 30.0)
            wid = f"{hello.get('node')}.{hello.get('local')}"
            if messages.kind(hello, messages.CONNECTING) is not Hello or hello.get("node") != self.node or wid in self.local:
                raise wire.ProtocolError(f"unexpected hello {hello!r} at node {self.node}'s relay")
        except (wire.ProtocolError, asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError) as e:
            log.warning("node %s: rejected a local connection: %s", self.node, str(e) or type(e).__name__)
            writer.close()
            return
        self.local[wid] = writer
        self.up.forward(wid, hello)
        closed: "asyncio.Future[str]" = asyncio.get_running_loop().create_future()
        wire.FrameProtocol(lambda m: self.up.forward(wid, m), lambda why: closed.done() or closed.set_result(why)).take_over(reader, writer)
        try:
            why = await closed
        except asyncio.CancelledError:  # the relay is ending (asyncio.run cancels what is left): nothing to report
            writer.close()
            return
        if self.local.get(wid) is writer:
            del self.local[wid]
            self.up.gone(wid, f"control connection closed ({why})")
        writer.close()

    def _deliver(self, workers: List[str], msg: Dict[str, Any]) -> None:
        frame = wire.encode(msg)
        what = messages.kind(msg, messages.TO_WORKER)
        if what is Stop:
            self.stopped.update(workers)
        for wid in workers:
            w = self.local.get(wid)
            if w is None or w.is_closing():
                continue
            w.write(frame)
            if what is Dropped:  # the coordinator declared it failed: said, then closed
                del self.local[wid]
                w.close()

    def _lost_coordinator(self, why: str) -> None:
        if self.stopped and set(self.local) <= self.stopped:
            log.info("node %s: the job is over (the coordinator closed its connection after the stops)", self.node)
        else:
            log.error("node %s: lost the coordinator (%s); closing the workers' connections", self.node, why)
        if not self.done.done():
            self.done.set_result(why)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptless_hpc.control.relay", description="a node's relay to the coordinator (cluster.control=node)")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator's control server")
    p.add_argument("--node", required=True)
    p.add_argument("--path", required=True, help="the node-local Unix socket the workers connect to")
    p.add_argument("--interval", type=float, required=True, help="seconds between heartbeat summaries (cluster.heartbeat_interval_s)")
    p.add_argument("--host", default="auto")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s %(levelname)s node={a.node} %(name)s: %(message)s")
    relay = Relay(a.node, a.coordinator, a.path, wire.load_secret(), a.interval, wire.resolve_host(a.host))
    why = asyncio.run(relay.run())
    log.info("node %s: relay done (%s)", a.node, why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
