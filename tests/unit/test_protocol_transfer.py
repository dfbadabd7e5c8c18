"""Framing, the HMAC handshake and peer state transfer over real loopback sockets."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from ckptless_hpc.control import wire
from ckptless_hpc.state.snapshot import apply_state, collect_state, state_sha256
from ckptless_hpc.state.transfer import StaleState, StateServer, TransferError, fetch_state
from ckptless_hpc.tasks.mlp import MLPTask

pytestmark = pytest.mark.timeout(30)
SECRET = "s" * 64


def test_frame_roundtrip_and_limits():
    a, b = socket.socketpair()
    wire.send_msg(a, {"type": "x", "n": 1})
    assert wire.recv_msg(b) == {"type": "x", "n": 1}
    a.sendall(struct.pack(">I", wire.MAX_FRAME + 1))
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        wire.recv_msg(b)
    a.sendall(struct.pack(">I", 3) + b"{x}")
    with pytest.raises(wire.ProtocolError, match="malformed"):
        wire.recv_msg(b)


def _handshake(client_secret: str):
    """Run both ends; return (server error or None, client error or None)."""
    a, b = socket.socketpair()
    box = {}

    def serve():
        try:
            wire.server_handshake(a, SECRET)
        except Exception as e:  # noqa: BLE001
            box["server"] = e
        finally:
            a.close()  # the real servers close a connection that failed to authenticate

    t = threading.Thread(target=serve)
    t.start()
    try:
        wire.client_handshake(b, client_secret)
    except Exception as e:  # noqa: BLE001
        box["client"] = e
    t.join(5)
    b.close()
    return box.get("server"), box.get("client")


def test_handshake_accepts_the_secret_and_refuses_others():
    assert _handshake(SECRET) == (None, None)
    server_err, client_err = _handshake("wrong")
    assert isinstance(server_err, wire.ProtocolError) and "authentication failed" in str(server_err)
    assert client_err is not None


def _trained(steps: int = 3):
    torch.manual_seed(0)
    task = MLPTask()
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        loss = task.loss(model, task.batch(s, 0, 1, torch.Generator().manual_seed(s)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return task, model, opt


def test_state_moves_bitwise_and_is_verified():
    task, model, opt = _trained()
    src = collect_state(model, opt, task, 3)
    served = {"step": 3}

    def provide(gen, step, shard=None, part="all"):
        if step != served["step"]:
            raise StaleState(f"holds step {served['step']}, asked for step {step}")
        return collect_state(model, opt, task, step)

    server = StateServer("127.0.0.1", SECRET, provide)
    got = fetch_state("127.0.0.1", server.port, SECRET, gen=1, step=3, timeout_s=10)
    assert got.nbytes > 0 and state_sha256(got.entries, got.meta) == state_sha256(*src)
    # load into a fresh replica and compare fingerprints
    torch.manual_seed(1)
    t2 = MLPTask()
    m2 = t2.build_model()
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    apply_state(m2, o2, t2, got.entries, got.meta)
    assert state_sha256(*collect_state(m2, o2, t2, 3)) == state_sha256(*src)
    with pytest.raises(TransferError, match="holds step 3, asked for step 4"):
        fetch_state("127.0.0.1", server.port, SECRET, gen=1, step=4, timeout_s=10)
    with pytest.raises(TransferError):
        fetch_state("127.0.0.1", server.port, "not-the-secret", gen=1, step=3, timeout_s=10)
    server.close()


@pytest.mark.parametrize("damage, message", [("corrupt", "checksum mismatch"), ("truncate", "truncated")])
def test_damaged_stream_is_detected(damage, message):
    """The source damages the bytes on the wire after checksumming them (the injected faults)."""
    task, model, opt = _trained(1)
    server = StateServer("127.0.0.1", SECRET, lambda gen, step, shard=None, **_: (*collect_state(model, opt, task, step), damage))
    try:
        with pytest.raises(TransferError, match=message):
            fetch_state("127.0.0.1", server.port, SECRET, gen=0, step=1, timeout_s=10)
    finally:
        server.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["fetch", "shard-copy"])
@pytest.mark.parametrize("damage", [None, "corrupt", "truncate"])
def test_both_hashings_move_bitwise_and_detect_damage(overlap, damage):
    """A fetch hashes 8 MB slices in a helper thread, a shard copy 1 MB pieces in its own thread
    (transfer._Hasher): either way the bytes arrive bitwise, and damage on the wire past the
    first piece is detected."""
    from ckptless_hpc.state import transfer as tr

    gen = torch.Generator().manual_seed(0)
    entries = [(f"t{i}", torch.randn(n, generator=gen)) for i, n in enumerate([3 << 20, 5, 1 << 20])]  # 12 MB, 20 B, 4 MB
    a, b = socket.socketpair()
    sent = threading.Thread(target=lambda: (tr._send_entries(a, entries, {"step": 7}, damage, target=0, overlap=overlap), a.close()), daemon=True)
    sent.start()
    try:
        head = tr._recv_big(b)
        if damage is None:
            got = tr._recv_entries(b, head, None, "peer", 7, overlap=overlap)
            assert [n for n, _ in got.entries] == [n for n, _ in entries]
            assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got.entries, entries))
        else:
            with pytest.raises(TransferError, match="checksum mismatch" if damage == "corrupt" else "truncated"):
                tr._recv_entries(b, head, None, "peer", 7, overlap=overlap)
    finally:
        sent.join(10)
        b.close()
