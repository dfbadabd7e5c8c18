"""The threaded servers (rendezvous store, state servers) against strangers, in-process, real
sockets: a total handshake deadline, a bounded handshake pool whose oldest gives way, a bound on
authenticated connections, accept errors survived (EMFILE under a lowered RLIMIT_NOFILE), and a
store that serves nothing to a client that failed its handshake (asserted on the attacker's side).
"""

from __future__ import annotations

import base64
import gc
import json
import logging
import os
import resource
import socket
import struct
import sys
import threading
import time
from typing import Any, List, Tuple

import pytest

from ckptless_hpc.control import listener, wire
from ckptless_hpc.control.listener import Listener, Throttle, accept_pause_s
from ckptless_hpc.control.rendezvous import AuthStore, StoreServer

pytestmark = pytest.mark.timeout(60)
SECRET = wire.new_secret()


class Served:
    """A Listener on 127.0.0.1 whose handler answers one frame with 'served', then holds the
    connection until ``release`` is set; every refusal is kept."""

    def __init__(self, preauth: int = 4, authed: int = 4, handshake_s: float = 10.0) -> None:
        self.rejects: List[Tuple[Any, str]] = []
        self.release = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.port = self.sock.getsockname()[1]
        self.listener = Listener(self.sock, SECRET, self._handle, "test server", preauth, authed, handshake_s, lambda a, why: self.rejects.append((a, why))).start()

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        wire.recv_msg(conn)
        wire.send_msg(conn, {"type": "served"})
        self.release.wait(30)

    def why(self, client: socket.socket) -> str:
        port = client.getsockname()[1]
        found = wait_until(lambda: [w for a, w in self.rejects if a[1] == port], f"a refusal of client port {port}")
        return found[0]

    def close(self) -> None:
        self.release.set()
        self.listener.close()


def wait_until(cond, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.01)


def peer(port: int) -> socket.socket:
    """A client that knows the secret, served once."""
    sock = wire.connect("127.0.0.1", port, SECRET, timeout_s=10)
    wire.send_msg(sock, {"type": "ask"})
    sock.settimeout(10)
    assert wire.recv_msg(sock)["type"] == "served"
    return sock


def stranger(port: int) -> socket.socket:
    """A client without the secret: it reads the challenge and says nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert wire.recv_msg(sock)["type"] == "challenge"
    return sock


def closed_by_server(sock: socket.socket, timeout_s: float = 20.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        while True:
            if sock.recv(4096) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


# ---------------------------------------------------------------------------- the deadline


def test_a_dripping_handshake_is_ended_at_its_total_deadline():
    """One byte every 0.25 s never lets a read wait for long, and still the handshake ends at its
    bound (1 s in all here), which a per-read timeout would never reach."""
    srv = Served(handshake_s=1.0)
    try:
        sock = stranger(srv.port)
        sock.settimeout(0.25)
        t0, drips = time.monotonic(), 0
        frame = wire.encode({"type": "auth", "mac": "0" * 64, "nonce": "ab" * 16})
        closed = False
        while not closed and drips < len(frame):
            try:
                closed = sock.recv(1) == b""
            except socket.timeout:
                try:
                    sock.sendall(frame[drips : drips + 1])
                    drips += 1
                except OSError:
                    closed = True
            except OSError:
                closed = True
        assert closed, f"the server still waits after {drips} bytes dripped over {time.monotonic() - t0:.1f}s"
        assert drips < len(frame), "the whole answer arrived: the drip was too fast to prove anything"
        assert "handshake not finished within 1s" in srv.why(sock)
        sock.close()
    finally:
        srv.close()


def test_the_handshake_functions_take_one_bound_for_all_their_reads():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"\x00\x00")  # half a length, then nothing: the server's second read would wait forever
        with pytest.raises(wire.ProtocolError, match="handshake not finished within 0.3s"):
            wire.server_handshake(a, SECRET, timeout_s=0.3)


# ---------------------------------------------------------------------------- the pools


def test_strangers_holding_every_handshake_slot_give_way_to_a_peer(monkeypatch):
    monkeypatch.setattr(listener, "EVICT_AGE_S", 0.0)  # they have all had long enough
    srv = Served(preauth=4, authed=4)
    try:
        held = [stranger(srv.port) for _ in range(4)]  # every handshake slot
        ok = peer(srv.port)
        assert "evicted" in srv.why(held[0]), srv.rejects  # the oldest gave way
        assert closed_by_server(held[0])
        assert not [w for a, w in srv.rejects if a[1] in [s.getsockname()[1] for s in held[1:]]], "only the oldest is evicted"
        for s in held + [ok]:
            s.close()
    finally:
        srv.close()


def test_a_newcomer_cannot_evict_handshakes_younger_than_the_eviction_age(monkeypatch):
    """A stranger reconnecting as soon as it is evicted cannot evict in turn the peer that just
    took its slot: young handshakes stay, the newcomer is refused (and told at once)."""
    monkeypatch.setattr(listener, "EVICT_AGE_S", 60.0)
    srv = Served(preauth=2, authed=4)
    try:
        held = [stranger(srv.port) for _ in range(2)]
        late = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        assert closed_by_server(late)
        assert "2 handshakes already in progress" in srv.why(late)
        assert len(srv.rejects) == 1, srv.rejects
        for s in held + [late]:
            s.close()
    finally:
        srv.close()


def test_authenticated_connections_past_the_bound_are_refused_and_reported():
    srv = Served(preauth=4, authed=1)
    try:
        first = peer(srv.port)  # held by the handler
        second = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        wire.client_handshake(second, SECRET, timeout_s=10)
        assert closed_by_server(second)
        assert "1 authenticated connections already open" in srv.why(second)
        srv.release.set()
        first.close()
        second.close()
    finally:
        srv.close()


# ---------------------------------------------------------------------------- accept errors


def test_pause_and_throttle():
    assert accept_pause_s(1) == 2 * listener.FIRST_PAUSE_S and accept_pause_s(100) == listener.MAX_PAUSE_S
    assert [accept_pause_s(n) <= accept_pause_s(n + 1) for n in range(20)] == [True] * 20
    t = Throttle(every_s=10)
    assert [t.due(0.0), t.due(1.0), t.due(9.9), t.due(10.0), t.due(10.5)] == [0, None, None, 2, None]


def test_emfile_is_survived_and_logged(caplog):
    """accept() failing with EMFILE (no descriptor left, RLIMIT_NOFILE lowered in this process)
    is logged and retried: once descriptors are free again, a peer is served."""
    srv = Served(preauth=64, authed=4)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: List[socket.socket] = []
    try:
        with caplog.at_level(logging.ERROR, logger="ckptless_hpc.control.listener"):
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
            try:
                while not srv.listener.accept_errors:
                    try:
                        held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
                    except OSError:  # this process is out of descriptors too: wait for the accept loop to notice
                        time.sleep(0.05)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            for s in held:
                s.close()
            peer(srv.port).close()
        assert any("accept() failed (EMFILE" in r.getMessage() and "test server" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        srv.close()


def test_only_a_closed_listener_ends_the_accept_loop():
    srv = Served()
    (loop,) = [t for t in threading.enumerate() if t.name == "accept test server"]
    srv.close()
    loop.join(10)
    assert not loop.is_alive()


# ---------------------------------------------------------------------------- the store


def _frame(msg: Any) -> bytes:
    body = json.dumps(msg).encode()
    return struct.pack(">I", len(body)) + body


def _read_all(sock: socket.socket, timeout_s: float = 20.0) -> Tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or ``timeout_s`` passes (False)."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got, True
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        return got, True
    except socket.timeout:
        return got, False


@pytest.mark.parametrize("attack", ["wrong_mac", "skip_auth"])
def test_the_store_serves_nothing_to_a_client_that_failed_its_handshake(attack):
    """On the attacker's side: after a wrong MAC (or no answer at all), requests sent on the same
    connection get no answer; the server closes it; the key's value never crosses the wire."""
    server = StoreServer("127.0.0.1", SECRET)
    value = b"the-value-of-gen0-rank0"
    try:
        owner = AuthStore("127.0.0.1", server.port, SECRET, timeout_s=10)
        owner.set("gen0/addr", value)
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        challenge = wire.recv_msg(sock)
        assert challenge["type"] == "challenge"
        asks = [{"type": "store", "op": "get", "key": "gen0/addr", "timeout_s": 1}, {"type": "store", "op": "num_keys"}, {"type": "store", "op": "set", "key": "gen1/x", "value": "Z2FyYmFnZQ=="}]
        first = _frame({"type": "auth", "mac": "0" * 64, "nonce": "ab" * 16}) if attack == "wrong_mac" else b""
        try:
            sock.sendall(first + b"".join(_frame(a) for a in asks))
        except (BrokenPipeError, ConnectionResetError):
            pass
        got, closed = _read_all(sock)
        sock.close()
        assert closed, "the store kept the connection of a client that failed its handshake"
        assert got == b"", f"the store answered a client that failed its handshake: {got[:200]!r}"
        assert value not in got and base64.b64encode(value) not in got
        assert owner.num_keys() == 1 and owner.check(["gen0/addr"]) and not owner.check(["gen1/x"])
        assert server.rejected >= 1
        owner.close()
    finally:
        server.close()


def test_a_store_client_that_cannot_connect_leaves_no_noise(capfd):
    """A failed connect raises one clear error; the half-built client says nothing when collected
    (it used to print AttributeError: ... '_sock' from __del__, once per attempt)."""
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nobody listens there
    seen: List[Any] = []
    old, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        with pytest.raises(ConnectionError, match=f"could not reach 127.0.0.1:{port}"):
            AuthStore("127.0.0.1", port, SECRET, timeout_s=0.5)
        gc.collect()
    finally:
        sys.unraisablehook = old
    assert not seen, [f"{u.exc_type.__name__}: {u.exc_value}" for u in seen]
    assert "AttributeError" not in capfd.readouterr().err
