"""What docs/security.md says about the handshake, checked in-process (no job, milliseconds).

If one fails, the code changed: update the doc.
"""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from ckptless_hpc.control import wire

pytestmark = pytest.mark.timeout(30)
SECRET = wire.new_secret()


def test_secret_and_nonce_sizes():
    assert len(bytes.fromhex(SECRET)) == 32  # 256-bit per-job secret
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=lambda: _quiet(wire.server_handshake, a, SECRET))
        t.start()
        challenge = wire.recv_msg(b)
        b.close()
        t.join(5)
    assert challenge["type"] == "challenge" and len(bytes.fromhex(challenge["nonce"])) == 16  # 128-bit nonce


def test_the_secret_never_crosses_the_wire():
    a, b = socket.socketpair()
    seen = bytearray()
    with a, b:
        t = threading.Thread(target=wire.server_handshake, args=(a, SECRET))
        t.start()
        challenge = wire.recv_msg(b)
        answer = wire.encode({"type": "auth", "mac": wire.mac(SECRET, challenge["nonce"]), "nonce": "ab" * 16})
        seen += answer
        b.sendall(answer)
        assert wire.recv_msg(b)["type"] == "welcome"
        t.join(5)
    assert SECRET.encode() not in seen


def test_oversized_length_is_refused_before_reading_the_body():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack(">I", 0xFFFFFFFF))  # and nothing else: recv_msg must not wait for it
        a.settimeout(5)
        with pytest.raises(wire.ProtocolError, match="exceeds"):
            wire.recv_msg(a)


def test_the_client_refuses_a_listener_without_the_secret():
    """The handshake is mutual: a rogue listener that answers 'welcome' without proving it knows
    the secret (an HMAC of the client's own nonce) is refused, so it can neither pose as the
    coordinator nor serve forged state."""
    a, b = socket.socketpair()
    got = {}

    def rogue_server() -> None:
        wire.send_msg(a, {"type": "challenge", "nonce": "chosen-by-the-rogue"})
        got["answer"] = wire.recv_msg(a)
        wire.send_msg(a, {"type": "welcome", "mac": "0" * 64})

    with a, b:
        t = threading.Thread(target=rogue_server)
        t.start()
        b.settimeout(5)
        with pytest.raises(wire.ProtocolError, match="did not prove"):
            wire.client_handshake(b, SECRET)
        t.join(5)
    # what the rogue got is bound to its nonce and to the client role: useless as a server proof
    assert got["answer"]["mac"] != wire.mac(SECRET, got["answer"]["nonce"], "server")


def test_deeply_nested_json_is_a_protocol_error():
    with pytest.raises(wire.ProtocolError):
        wire.decode(b"[" * 100_000)


def test_non_ascii_mac_is_an_authentication_failure():
    a, b = socket.socketpair()
    with a, b:
        wire.send_msg(b, {"type": "auth", "mac": "\u00e9" * 64})
        a.settimeout(5)
        with pytest.raises(wire.ProtocolError, match="authentication failed"):
            wire.server_handshake(a, SECRET)


def _quiet(fn, *args):
    try:
        fn(*args)
    except (wire.ProtocolError, OSError):
        pass
