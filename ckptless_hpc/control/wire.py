"""Wire format shared by the control channel and the state-transfer endpoints.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON. Frames larger
than ``MAX_FRAME`` are refused before they are read. Every connection starts with an HMAC
challenge: the server sends a fresh nonce, the client answers HMAC-SHA256(secret, nonce), and
only then is anything else accepted. The per-job secret reaches workers through the
environment of their process (``SECRET_ENV``) or a file readable only by the job's user, never
through a command line.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import random
import secrets
import socket
import struct
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .messages import HANDSHAKE, Auth, Challenge, Welcome, kind

MAX_FRAME = 1 << 20
AUTH_FRAME = 1024  # an unauthenticated peer may send this much, no more
SECRET_ENV = "CKPTLESS_SECRET"
SECRET_FILE_ENV = "CKPTLESS_SECRET_FILE"
_HDR = struct.Struct(">I")
_DOMAIN = b"ckptless-hpc/v1|"


class ProtocolError(Exception):
    """A peer broke the protocol: bad length, bad JSON, failed authentication."""


def new_secret() -> str:
    return secrets.token_hex(32)


def load_secret(env: Optional[Dict[str, str]] = None) -> str:
    env = os.environ if env is None else env
    if env.get(SECRET_ENV):
        return env[SECRET_ENV]
    path = env.get(SECRET_FILE_ENV)
    if path:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    raise ProtocolError(
        f"no job secret: neither {SECRET_ENV} nor {SECRET_FILE_ENV} is set. HINT: workers are started by the coordinator, which hands them the secret; do not start them by hand"
    )


def resolve_host(value: str) -> str:
    """``auto`` = the address this node's hostname resolves to (its cluster-facing address)."""
    if value != "auto":
        return value
    return socket.gethostbyname(socket.gethostname())


def mac(secret: str, nonce: str, role: str = "client") -> str:
    return hmac.new(secret.encode(), _DOMAIN + role.encode() + b"|" + nonce.encode(), hashlib.sha256).hexdigest()


def _mac_ok(answer: Any, secret: str, nonce: str, role: str) -> bool:
    given = answer if isinstance(answer, str) else ""
    return hmac.compare_digest(given.encode("utf-8", "replace"), mac(secret, nonce, role).encode())


def encode_body(msg: Dict[str, Any]) -> bytes:
    """A message's JSON, no length header: ``encode`` frames it; a relay link nests it in a batch."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return body


def encode(msg: Dict[str, Any]) -> bytes:
    return frame(encode_body(msg))


def frame(body: bytes) -> bytes:
    """Length header + ``body`` (already checked against ``MAX_FRAME``)."""
    return _HDR.pack(len(body)) + body


def decode(body: bytes) -> Dict[str, Any]:
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, absurd nesting
        raise ProtocolError(f"malformed frame: {type(e).__name__}: {str(e)[:100]}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("malformed frame: not an object with a string 'type'")
    return msg


def _check_len(n: int, max_len: int = MAX_FRAME) -> int:
    if n > max_len:
        raise ProtocolError(f"frame length {n} exceeds the {max_len}-byte limit")
    return n


# ---------------------------------------------------------------------------- blocking side


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes; with a ``deadline`` (time.monotonic()), all of them by then (TimeoutError)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            sock.settimeout(_left(deadline, got, n))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _left(deadline: float, got: int, n: int) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"deadline passed after {got} of {n} bytes")
    return left


def recv_msg(sock: socket.socket, max_len: int = MAX_FRAME, deadline: Optional[float] = None) -> Dict[str, Any]:
    (n,) = _HDR.unpack(recv_exact(sock, 4, deadline))
    return decode(recv_exact(sock, _check_len(n, max_len), deadline))


def send_msg(sock: socket.socket, msg: Dict[str, Any], deadline: Optional[float] = None) -> None:
    if deadline is not None:
        sock.settimeout(_left(deadline, 0, 0))
    sock.sendall(encode(msg))


def _deadline(timeout_s: Optional[float]) -> Optional[float]:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _late(timeout_s: Optional[float]) -> ProtocolError:
    return ProtocolError(f"handshake not finished within {timeout_s:g}s (a bound on the whole handshake, not on each read)")


def client_handshake(sock: socket.socket, secret: str, timeout_s: Optional[float] = None) -> None:
    """Prove we know the secret, and make the server prove it too (mutual: no rogue listener);
    all of it within ``timeout_s`` when given (TimeoutError after it: the caller may retry)."""
    mine = secrets.token_hex(16)
    deadline = _deadline(timeout_s)
    send_msg(sock, _answer_challenge(recv_msg(sock, deadline=deadline), secret, mine), deadline)
    _check_welcome(recv_msg(sock, deadline=deadline), secret, mine)


def _answer_challenge(challenge: Dict[str, Any], secret: str, mine: str) -> Dict[str, Any]:
    if kind(challenge, HANDSHAKE) is not Challenge or not isinstance(challenge.get("nonce"), str):
        raise ProtocolError(f"expected a challenge, got {challenge.get('type')!r}")
    return Auth(mac(secret, challenge["nonce"]), mine).encode()


def _check_welcome(reply: Dict[str, Any], secret: str, mine: str) -> None:
    if kind(reply, HANDSHAKE) is not Welcome or not _mac_ok(reply.get("mac"), secret, mine, "server"):
        raise ProtocolError("the server did not prove it knows the job secret")


def _check_answer(answer: Dict[str, Any], secret: str, nonce: str) -> Dict[str, Any]:
    if kind(answer, HANDSHAKE) is not Auth or not _mac_ok(answer.get("mac"), secret, nonce, "client"):
        raise ProtocolError("authentication failed: wrong or missing MAC")
    theirs = answer.get("nonce")
    if not isinstance(theirs, str) or not 16 <= len(theirs) <= 64:
        raise ProtocolError("authentication failed: missing client nonce")
    return Welcome(mac(secret, theirs, "server")).encode()


def server_handshake(sock: socket.socket, secret: str, timeout_s: Optional[float] = None) -> None:
    """Challenge, check the answer, prove we know the secret too; with ``timeout_s``, all of it
    within that bound (ProtocolError after it: a peer dripping a byte at a time gets no more
    time than a silent one)."""
    nonce = secrets.token_hex(16)
    deadline = _deadline(timeout_s)
    try:
        send_msg(sock, Challenge(nonce).encode(), deadline)
        send_msg(sock, _check_answer(recv_msg(sock, AUTH_FRAME, deadline), secret, nonce), deadline)
    except TimeoutError:
        raise _late(timeout_s) from None


def connect(host: str, port: int, secret: str, timeout_s: float = 10.0) -> socket.socket:
    """One attempt: connect and authenticate within ``timeout_s`` (state transfer: a dead
    source must fail fast so that the next one is tried)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(sock, secret, timeout_s)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def backoff_s(attempt: int, rng: random.Random, base_s: float = 0.1, cap_s: float = 3.0) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap_s, base_s * 2**attempt)]."""
    return rng.uniform(0.0, min(cap_s, base_s * (2 ** min(attempt, 30))))


def attempt_wait_s(attempt: int, first_s: float = 10.0, cap_s: float = 30.0) -> float:
    """How long one attempt waits for the server's challenge: doubles, up to ``cap_s``."""
    return min(cap_s, first_s * (2 ** min(attempt, 30)))


def _unreachable(host: str, port: int, timeout_s: float, errors: List[str]) -> ConnectionError:
    return ConnectionError(
        f"could not reach {host}:{port} within {timeout_s:.0f}s ({len(errors)} attempts: {', '.join(sorted(set(errors)))}). "
        "HINT: check that the coordinator is running and that this node can reach cluster.bind_host"
    )


def connect_paced(host: str, port: int, secret: str, timeout_s: float = 120.0, first_wait_s: float = 10.0, rng: Optional[random.Random] = None) -> socket.socket:
    """Connect to a server that thousands of clients reach at once (the coordinator).

    The server speaks first, and a full listen queue drops a connection that the client
    believes open: so each attempt waits a bounded time for the challenge, then the client
    closes, backs off (jittered, so the burst spreads) and tries again, until ``timeout_s``.
    A failed authentication is not retried.
    """
    rng = rng or random.Random()
    deadline = time.monotonic() + timeout_s
    errors = []
    for attempt in range(1 << 30):
        left = deadline - time.monotonic()
        try:
            return connect(host, port, secret, timeout_s=max(0.05, min(left, attempt_wait_s(attempt, first_wait_s))))
        except (TimeoutError, ConnectionError) as e:
            errors.append(type(e).__name__)
        pause = backoff_s(attempt, rng)
        if time.monotonic() + pause >= deadline:
            break
        time.sleep(pause)
    raise _unreachable(host, port, timeout_s, errors)


# ---------------------------------------------------------------------------- asyncio side


async def arecv_msg(reader: asyncio.StreamReader, max_len: int = MAX_FRAME) -> Dict[str, Any]:
    (n,) = _HDR.unpack(await reader.readexactly(4))
    return decode(await reader.readexactly(_check_len(n, max_len)))


async def aserver_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str, timeout_s: float) -> None:
    """``server_handshake`` on a stream: all of it within ``timeout_s`` (ProtocolError after)."""
    try:
        await asyncio.wait_for(_aserver_handshake(reader, writer, secret), timeout_s)
    except asyncio.TimeoutError:
        raise _late(timeout_s) from None


async def _aserver_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str) -> None:
    nonce = secrets.token_hex(16)
    writer.write(encode(Challenge(nonce).encode()))
    await writer.drain()
    answer = await arecv_msg(reader, max_len=AUTH_FRAME)
    writer.write(encode(_check_answer(answer, secret, nonce)))
    await writer.drain()


async def aclient_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str, timeout_s: float) -> None:
    """``client_handshake`` on a stream: each of the server's two frames within ``timeout_s``."""
    mine = secrets.token_hex(16)
    writer.write(encode(_answer_challenge(await asyncio.wait_for(arecv_msg(reader), timeout_s), secret, mine)))
    _check_welcome(await asyncio.wait_for(arecv_msg(reader), timeout_s), secret, mine)


async def aconnect_paced(
    host: str, port: int, secret: str, timeout_s: float = 120.0, first_wait_s: float = 10.0, rng: Optional[random.Random] = None
) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``connect_paced`` for an asyncio client (a node's relay, B7's simulated ranks)."""
    rng = rng or random.Random()
    deadline = time.monotonic() + timeout_s
    errors = []
    for attempt in range(1 << 30):
        wait = max(0.05, min(deadline - time.monotonic(), attempt_wait_s(attempt, first_wait_s)))
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), wait)
        except (asyncio.TimeoutError, OSError) as e:
            errors.append(type(e).__name__)
        else:
            try:
                await aclient_handshake(reader, writer, secret, wait)
                return reader, writer
            except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
                errors.append(type(e).__name__)
                writer.close()
            except BaseException:
                writer.close()
                raise
        pause = backoff_s(attempt, rng)
        if time.monotonic() + pause >= deadline:
            break
        await asyncio.sleep(pause)
    raise _unreachable(host, port, timeout_s, errors)


def connect_unix(path: str, secret: str, timeout_s: float = 60.0) -> socket.socket:
    """Connect and authenticate to a node-local server at ``path`` (the node's relay), retrying
    while it is not listening yet (it starts next to the workers), until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.05, min(10.0, deadline - time.monotonic())))
            sock.connect(path)
            client_handshake(sock, secret)
            sock.settimeout(None)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"no relay listening at {path} within {timeout_s:.0f}s ({type(e).__name__}). "
                    "HINT: the node's relay (python -m ckptless_hpc.control.relay) did not start: see its log"
                ) from None
            time.sleep(0.05)
        except BaseException:
            sock.close()
            raise


class FrameProtocol(asyncio.Protocol):
    """The frames of a connection as they arrive: every complete frame of a read is handled in
    that one callback (no coroutine, future or wake-up per frame). ``on_message`` gets each
    message; ``on_closed`` once, with why. Installed on an authenticated connection in place of
    the stream reader (``take_over``)."""

    def __init__(self, on_message: Callable[[Dict[str, Any]], None], on_closed: Callable[[str], None], max_len: int = MAX_FRAME) -> None:
        self._on_message, self._on_closed, self._max = on_message, on_closed, max_len
        self._buf = bytearray()
        self._transport: Any = None
        self._closed = False

    def take_over(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read ``writer``'s connection from now on, starting with what ``reader`` buffered."""
        leftover = getattr(reader, "_buffer", None)
        self.connection_made(writer.transport)
        writer.transport.set_protocol(self)
        if leftover:
            data = bytes(leftover)
            leftover.clear()
            self.data_received(data)
        if reader.at_eof() or reader.exception() is not None or writer.transport.is_closing():
            self._close("EOF")  # it went away before we took over: no connection_lost will come

    def pending(self) -> int:
        """Bytes received and not yet handled."""
        return len(self._buf)

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, n = 0, len(buf)
        try:
            while n - pos >= 4 and not self._closed:
                end = pos + 4 + _check_len(_HDR.unpack_from(buf, pos)[0], self._max)
                if end > n:
                    break
                msg = decode(bytes(buf[pos + 4 : end]))
                pos = end
                self._on_message(msg)
        except ProtocolError as e:
            self._close(f"ProtocolError: {e}")
            return
        del buf[:pos]

    def eof_received(self) -> bool:
        return False  # close our end too

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._close("EOF" if exc is None else type(exc).__name__)

    def _close(self, why: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._buf.clear()
        if self._transport is not None:
            self._transport.close()
        self._on_closed(why)
