"""Peer-to-peer state transfer over authenticated TCP.

Every worker runs a ``StateServer``. A replacement connects to the source the coordinator
chose, proves it knows the job secret, and asks for the state of (generation, step). The
source answers only while it holds exactly that step (a request for any other step is refused
with both step numbers), streams a header, the raw tensor bytes in canonical order and an
xxh3-64 checksum trailer (about 11 GB/s here, where CRC32 ran at 3.7 GB/s and halved the
transfer rate). The receiver checks length and checksum before anything is trained on.

A request may ask for one part of the state (``part``: ``first``, what a step's forward and
backward need: parameters, buffers, the task's tensors; ``rest``, the optimizer state, which
only the optimizer step needs) and for one of ``of`` disjoint groups of that part
(:func:`select`: contiguous entries balanced by bytes, the same on every replica), so that a
replacement can fetch the parameters first and several groups from several sources at once.
Every response, whatever it holds, carries its own checksum and is verified on its own.
"""

from __future__ import annotations

import logging
import math
import socket
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import xxhash

from ..control import wire
from ..control.listener import Listener
from ..control import messages
from ..control.messages import STATE_PORT, Ack, End, Fetch, Refused, Replica, StateHeader
from .snapshot import Entries, byte_view
from .staging import host_slices

log = logging.getLogger(__name__)

MAX_HEADER = 64 << 20
MAX_CONNECTIONS = 32  # concurrent authenticated state requests served; more are refused at once
MAX_HANDSHAKES = 32  # connections in their handshake at once (listener.py: the oldest gives way)
HANDSHAKE_TIMEOUT_S = 10.0  # for the whole handshake; then the same again for the request


# every dtype of this torch whose tensors are plain bytes (complex RoPE caches, bool masks,
# integer counters, fp8 where torch has it): a state is carried whatever its model holds
def _plain_bytes(d: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32's "experimental" warning
            torch.zeros(1, dtype=d).view(torch.uint8)
        return True
    except (RuntimeError, TypeError):  # quantized and other non-byte dtypes
        return False


_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype) and _plain_bytes(d)}


SLICE = 8 << 20  # bytes staged (device tensors), and moved then hashed at a time by a fetch
PIECE = 1 << 20  # bytes moved then hashed at a time by a shard copy: hashed while still in the core's cache


class _Hasher:
    """xxh3-64 over a stream of pieces of ``piece`` bytes. A fetch (``overlap``: a replacement
    waits for it) hashes each 8 MB slice in a helper thread while the next one moves (xxhash
    releases the GIL); a shard copy, made every step beside the training, hashes each 1 MB
    piece in the thread that moves it (the sender before it sends it, the holder after it
    arrives), from the core's cache: no second pass over
    memory, and no thread started per slice, each of whose starts took the GIL from the
    training thread (2 to 3 times the training thread's context switches, 20-30 % more CPU
    per copy measured with a GIL-holding thread beside it: issue 30)."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.piece = SLICE if overlap else PIECE
        self._digest = xxhash.xxh3_64()
        self._pending: Optional[threading.Thread] = None

    def update(self, data: memoryview) -> None:
        if not self.overlap:
            self._digest.update(data)
            return
        self._wait()
        self._pending = threading.Thread(target=self._digest.update, args=(data,), daemon=True)
        self._pending.start()

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.join()
            self._pending = None

    def hexdigest(self) -> str:
        self._wait()
        return self._digest.hexdigest()


class StaleState(Exception):
    """The source does not hold the requested (generation, step)."""


class TransferError(Exception):
    """A transfer failed: refused, truncated, or checksum mismatch. ``sources``: the peers whose
    attempts failed (a fetch's: the coordinator blames them, not the fetcher)."""

    def __init__(self, message: str, sources: Tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.sources = sources


class Unreadable(TransferError):
    """What was sent is whole but cannot be taken (a dtype this torch has not): sending it again
    changes nothing; a holder answers it with ``refused``."""


class CopyRefused(TransferError):
    """A holder refused a copy for what it holds (:class:`Unreadable`), not for the wire: never retried."""


PARTS = ("all", "first", "rest")

# (gen, step, shard or None, part=) -> (entries, meta) of the whole state held, or, to inject a
# wire fault, (entries, meta, "corrupt" | "truncate", "first" | "optimizer": the entry it strikes)
Provider = Callable[..., Tuple[Any, ...]]


def in_part(name: str, part: str) -> bool:
    """Whether state entry ``name`` belongs to ``part`` (the optimizer's entries are the rest)."""
    if part == "all":
        return True
    return name.startswith("optim.") == (part == "rest")


def select(entries: Entries, part: str = "all", index: int = 0, of: int = 1) -> Entries:
    """Group ``index`` of ``of`` of the entries of ``part``: contiguous runs in canonical order,
    cut where the running byte count passes each ``k/of`` of the part's bytes (pure: replicas
    holding the same shapes cut at the same entries). Groups may be empty."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}: unknown part of the state. HINT: use one of {', '.join(PARTS)}")
    if not 0 <= index < of:
        raise ValueError(f"group {index} of {of}: no such group. HINT: 0 <= index < of")
    chosen = [(n, t) for n, t in entries if in_part(n, part)]
    total = sum(t.numel() * t.element_size() for _, t in chosen)
    out: Entries = []
    run = 0
    for n, t in chosen:
        size = t.numel() * t.element_size()
        group = min(of - 1, (run * of) // total) if total else 0  # where the entry starts
        if group == index:
            out.append((n, t))
        run += size
    return out


@dataclass
class Received:
    entries: Entries
    meta: Dict[str, Any]
    nbytes: int
    seconds: float
    cpu_s: float = 0.0  # a pushed copy: the receiving thread's CPU for it (bench B8)


@dataclass(frozen=True)
class Want:
    """What a fetch asks a source for: the state of (gen, step), of shard ``shard`` (sharded
    state), its ``part``, and of that part the group ``index`` of ``of`` (:func:`select`)."""

    gen: int
    step: int
    shard: Optional[int] = None
    part: str = "all"
    index: int = 0
    of: int = 1

    def describe(self) -> str:
        what = {"all": "state", "first": "parameters", "rest": "optimizer state"}[self.part]
        what += f" of shard {self.shard}" if self.shard is not None else ""
        return what + (f" (group {self.index + 1} of {self.of})" if self.of > 1 else "")


# (gen, shard, step, received) -> None: a verified copy of a peer's shard
Receiver = Callable[[int, int, int, "Received"], None]


def _send_entries(conn: socket.socket, entries: Entries, meta: Dict[str, Any], damage: Optional[str] = None, target: int = 0, overlap: bool = True) -> None:
    """Header, raw bytes in canonical order, xxh3-64 trailer (``damage``: an injected fault, in
    the middle of entry ``target``; ``overlap``: see :class:`_Hasher`)."""
    header = [{"name": n, "dtype": str(t.dtype), "shape": list(t.shape)} for n, t in entries]
    odd = next((h for h in header if h["dtype"] not in _DTYPES), None)
    if odd is not None:  # the peer could not take it either
        raise Unreadable(f"{odd['name']}: dtype {odd['dtype']} cannot be sent as plain bytes")
    _send_big(conn, StateHeader(header, meta).encode())
    digest = _Hasher(overlap)
    tensors = [t for _, t in entries]
    cut = (tensors[target].numel() * tensors[target].element_size()) // 2 if tensors else 0  # where an injected fault strikes
    for i, off, part in host_slices(tensors, SLICE):  # device tensors staged through pinned memory
        out = part
        if damage and i == target:  # injected fault: the bytes on the wire differ from the state
            if damage == "truncate" and off + len(part) > cut:
                conn.sendall(part[: cut - off])
                return
            if damage == "corrupt" and off <= cut < off + len(part):
                bad = bytearray(part)
                bad[cut - off] ^= 0xFF
                out = memoryview(bad)
        for at in range(0, len(part), digest.piece):  # hashed first: the send reads it from cache, or while it sends (overlap)
            digest.update(part[at : at + digest.piece])
            conn.sendall(out[at : at + digest.piece])
    wire.send_msg(conn, End(digest.hexdigest()).encode())


def _recv_entries(
    sock: socket.socket,
    head: Dict[str, Any],
    arena: Optional["Arena"],
    peer: str,
    step: int,
    want: Optional["Want"] = None,
    reuse: Optional[Dict[str, torch.Tensor]] = None,
    overlap: bool = True,
) -> "Received":
    """The body after a state header: tensors, then a trailer whose checksum must match. Each
    lands in ``reuse``'s tensor of its name where shape and dtype match, else in ``arena``, else
    in fresh memory (``overlap``: see :class:`_Hasher`)."""
    t0 = time.monotonic()
    want = want or Want(-1, step)
    entries: Entries = []
    digest = _Hasher(overlap)
    nbytes = 0
    for e in head["entries"]:
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise Unreadable(f"{e['name']}: dtype {e['dtype']} is not one this torch ({torch.__version__}) can hold")
        if not in_part(e["name"], want.part):
            raise TransferError(f"{peer} sent {e['name']}, which is not in the part asked for ({want.part})")
        t = (reuse or {}).get(e["name"])
        if t is None or list(t.shape) != list(e["shape"]) or t.dtype != dtype:
            t = arena.take(e["shape"], dtype) if arena is not None else torch.empty(e["shape"], dtype=dtype)
        mv = byte_view(t)
        for off in range(0, len(mv), digest.piece):
            part = mv[off : off + digest.piece]
            got = 0
            while got < len(part):
                k = sock.recv_into(part[got:])
                if k == 0:
                    raise TransferError(f"transfer truncated in {e['name']} after {nbytes + off + got} bytes")
                got += k
            digest.update(part)
        nbytes += len(mv)
        entries.append((e["name"], t))
    trailer = wire.recv_msg(sock)
    if messages.kind(trailer, STATE_PORT) is not End or trailer.get("xxh3_64") != digest.hexdigest():
        raise TransferError(f"checksum mismatch from {peer}: got xxh3_64 {digest.hexdigest()}, source says {trailer.get('xxh3_64')}")
    if head["meta"].get("step") != step:
        raise TransferError(f"{peer} sent step {head['meta'].get('step')}, asked for step {step}")
    return Received(entries, head["meta"], nbytes, time.monotonic() - t0)


def _recv_big(sock: socket.socket) -> Dict[str, Any]:
    (n,) = struct.unpack(">I", wire.recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise wire.ProtocolError(f"state header of {n} bytes exceeds {MAX_HEADER}")
    return wire.decode(wire.recv_exact(sock, n))


def _send_big(sock: socket.socket, msg: Dict[str, Any]) -> None:
    import json

    body = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


class StateServer:
    """Serves this worker's committed state to authenticated peers (one thread per request)."""

    def __init__(
        self,
        bind_host: str,
        secret: str,
        provider: Provider,
        describe: str = "",
        receiver: Optional[Receiver] = None,
        landing: Optional[Callable[[int], Dict[str, torch.Tensor]]] = None,
    ) -> None:
        self._secret = secret
        self._provider = provider
        self._receiver = receiver
        self._landing = landing  # shard -> buffers its next pushed copy may land in
        self._describe = describe
        self._sock = socket.create_server((bind_host, 0), backlog=64)
        self.host = bind_host
        self.port = self._sock.getsockname()[1]
        self._listener = Listener(
            self._sock, secret, self._serve, f"{describe}state server {bind_host}:{self.port}", MAX_HANDSHAKES, MAX_CONNECTIONS, HANDSHAKE_TIMEOUT_S, self._rejected
        )
        self._listener.start()  # once assigned: a handler may use it at once

    @property
    def refused(self) -> int:
        """Requests refused: failed or unfinished handshakes, no slot free, bad or stale requests."""
        return self._listener.rejected

    def _rejected(self, addr: Any, why: Any) -> None:
        log.warning("%sstate request from %s rejected: %s", self._describe, addr, why)

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            req = wire.recv_msg(conn)
            what = messages.kind(req, STATE_PORT)  # its fields are read below as before (a bad one: rejected, with the same words)
            if what is Replica and self._receiver is not None:
                return self._take_replica(conn, req)
            if what is not Fetch:
                raise wire.ProtocolError(f"expected fetch, got {req.get('type')!r}")
            shard = req.get("shard")
            want = Want(int(req["gen"]), int(req["step"]), None if shard is None else int(shard), str(req.get("part", "all")), int(req.get("index", 0)), int(req.get("of", 1)))
            try:
                entries, meta, *damage = self._provider(want.gen, want.step, want.shard, part=want.part)
                entries = select(entries, want.part, want.index, want.of)
            except StaleState as e:
                wire.send_msg(conn, Refused(str(e)).encode())
                return
            conn.settimeout(None)
            kind, strikes = (damage + [None, None])[:2]
            target = next((i for i, (n, _) in enumerate(entries) if n.startswith("optim.")), 0) if strikes == "optimizer" else 0
            _send_entries(conn, entries, meta, kind, target)
        except (wire.ProtocolError, ConnectionError, OSError, ValueError, KeyError, TypeError, TransferError) as e:
            self._listener.reject(addr, e)

    def _take_replica(self, conn: socket.socket, req: Dict[str, Any]) -> None:
        """A peer pushes a copy of its shard (parallel=zero|fsdp): received, verified, kept, acked."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S * 6)
        cpu0 = time.thread_time()
        head = _recv_big(conn)
        try:
            reuse = self._landing(int(req["shard"])) if self._landing is not None else None
            got = _recv_entries(conn, head, None, "replica", int(req["step"]), reuse=reuse, overlap=False)
        except Unreadable as e:
            wire.send_msg(conn, Refused(str(e)).encode())
            raise
        got.cpu_s = time.thread_time() - cpu0
        assert self._receiver is not None
        self._receiver(int(req["gen"]), int(req["shard"]), int(req["step"]), got)
        wire.send_msg(conn, Ack(int(req["step"])).encode())

    def close(self) -> None:
        self._listener.close()


class Arena:
    """Memory a hot spare pre-faults while it waits, to receive its state into.

    Receiving into fresh memory runs at the speed of page faults (1.3 GB/s here against
    2-3 GB/s into touched memory), so an idle spare touches its landing buffer ahead of time.
    Tensors carved from it are views: once loaded, the optimizer state may keep living there.
    """

    def __init__(self, nbytes: int, pinned: bool = False) -> None:
        # zeros: every page touched now, not later; pinned (a CUDA worker): the copies to the
        # device after the checksum run at DMA speed
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        if pinned:
            self.buf = self.buf.pin_memory()
        self.offset = 0
        self._lock = threading.Lock()  # several transfers land in it at once (several sources)

    def take(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            start = -(-self.offset // 64) * 64
            if start + n > self.buf.numel():
                return torch.empty(shape, dtype=dtype)  # the estimate was short: fresh memory for the rest
            self.offset = start + n
        return self.buf[start : start + n].view(dtype).view(shape)


def _connect(host: str, port: int, secret: str, timeout_s: float, what: str) -> socket.socket:
    """An authenticated connection to a peer's StateServer, with ``timeout_s`` on every read."""
    try:
        sock = wire.connect(host, port, secret, timeout_s=timeout_s)
    except (OSError, wire.ProtocolError) as e:
        raise TransferError(f"cannot reach {what} {host}:{port}: {e}") from None
    sock.settimeout(timeout_s)
    return sock


def fetch_state(host: str, port: int, secret: str, gen: int, step: int, timeout_s: float, arena: Optional[Arena] = None, shard: Optional[int] = None) -> Received:
    """Fetch (gen, step) -- of shard ``shard`` for sharded state -- from a peer's StateServer;
    raises TransferError on any problem."""
    if arena is not None:
        arena.offset = 0
    return fetch_part(host, port, secret, Want(gen, step, shard), timeout_s, arena)


def fetch_part(host: str, port: int, secret: str, want: Want, timeout_s: float, arena: Optional[Arena] = None) -> Received:
    """Fetch what ``want`` names from a peer's StateServer, verified; TransferError on any problem
    (``arena``: land in it from where it is, several fetches may share it)."""
    t0 = time.monotonic()
    step = want.step
    sock = _connect(host, port, secret, timeout_s, "state source")
    try:
        wire.send_msg(sock, Fetch(want.gen, step, want.shard, want.part, want.index, want.of).encode())
        head = _recv_big(sock)
        if messages.kind(head, STATE_PORT) is Refused:
            raise TransferError(f"source {host}:{port} refused: {head.get('reason')}")
        got = _recv_entries(sock, head, arena, f"{host}:{port}", step, want)
        got.seconds = time.monotonic() - t0
        return got
    except (OSError, ConnectionError, wire.ProtocolError, KeyError) as e:
        raise TransferError(f"transfer from {host}:{port} failed: {e}") from None
    finally:
        sock.close()


def push_state(host: str, port: int, secret: str, gen: int, shard: int, step: int, entries: Entries, meta: Dict[str, Any], timeout_s: float) -> float:
    """Send a copy of this rank's shard at ``step`` to a holder; returns once the holder has
    verified and kept it (its ack), in seconds. Raises TransferError on any problem."""
    t0 = time.monotonic()
    sock = _connect(host, port, secret, timeout_s, "holder")
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire.send_msg(sock, Replica(gen, shard, step).encode())
        _send_entries(sock, entries, meta, overlap=False)
        ack = wire.recv_msg(sock)
        if messages.kind(ack, STATE_PORT) is Refused:
            raise CopyRefused(f"holder {host}:{port} refused the copy of step {step}: {ack.get('reason')}")
        if messages.kind(ack, STATE_PORT) is not Ack or ack.get("step") != step:
            raise TransferError(f"holder {host}:{port} did not acknowledge step {step}: {ack}")
        return time.monotonic() - t0
    except (OSError, ConnectionError, wire.ProtocolError, KeyError) as e:
        raise TransferError(f"copy to holder {host}:{port} failed: {e}") from None
    finally:
        sock.close()
