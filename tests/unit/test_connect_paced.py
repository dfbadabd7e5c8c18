"""Paced connection: a connection the server never speaks on is retried, with jittered backoff."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from ckptless_hpc.control import wire

pytestmark = pytest.mark.timeout(30)
SECRET = "k" * 64


def test_backoff_is_jittered_and_capped():
    rng = random.Random(1)
    waits = [wire.backoff_s(a, rng) for a in range(40)]
    assert all(0 <= w <= 3.0 for w in waits) and len(set(waits)) == 40
    assert all(wire.backoff_s(0, rng) <= 0.1 for _ in range(100))
    assert wire.attempt_wait_s(0) == 10.0 and wire.attempt_wait_s(10) == 30.0


def _server(silent_first: int, stop: threading.Event):
    """A real listener: the first ``silent_first`` connections are accepted and never spoken to
    (what a client sees when a full listen queue dropped it), the next one is served."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    held = []

    def serve() -> None:
        for _ in range(silent_first):
            held.append(srv.accept()[0])
        conn, _ = srv.accept()
        wire.server_handshake(conn, SECRET)
        stop.wait(10)
        for c in held + [conn]:
            c.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return port


def test_a_silent_accepted_connection_is_retried_until_served():
    stop = threading.Event()
    port = _server(2, stop)
    sock = wire.connect_paced("127.0.0.1", port, SECRET, timeout_s=20, first_wait_s=0.2, rng=random.Random(0))
    try:
        assert sock.gettimeout() is None
    finally:
        sock.close()
        stop.set()


def test_no_server_fails_with_the_address_and_a_hint():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with pytest.raises(ConnectionError) as e:
        wire.connect_paced("127.0.0.1", port, SECRET, timeout_s=0.5, first_wait_s=0.1)
    assert f"127.0.0.1:{port}" in str(e.value) and "HINT" in str(e.value)


def test_a_server_that_cannot_prove_the_secret_is_not_retried():
    srv = socket.create_server(("127.0.0.1", 0))

    def rogue() -> None:
        conn, _ = srv.accept()
        wire.send_msg(conn, {"type": "challenge", "nonce": "n" * 32})
        wire.recv_msg(conn)
        wire.send_msg(conn, {"type": "welcome", "mac": "0" * 64})
        conn.close()
        srv.close()

    threading.Thread(target=rogue, daemon=True).start()
    with pytest.raises(wire.ProtocolError, match="did not prove"):
        wire.connect_paced("127.0.0.1", srv.getsockname()[1], SECRET, timeout_s=20, first_wait_s=0.2)
