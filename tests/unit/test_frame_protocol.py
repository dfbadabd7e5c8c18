"""wire.FrameProtocol: frames split and joined across reads, oversized and malformed frames."""

from __future__ import annotations

import pytest

from ckptless_hpc.control import wire

pytestmark = pytest.mark.timeout(10)


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _proto():
    got, why = [], []
    p = wire.FrameProtocol(got.append, why.append)
    t = _Transport()
    p.connection_made(t)
    return p, t, got, why


def test_frames_split_and_joined_across_reads_are_delivered_in_order():
    p, t, got, why = _proto()
    data = b"".join(wire.encode({"type": "hb", "i": i}) for i in range(50))
    for k in range(0, len(data), 7):  # 7-byte reads: every frame split, some reads hold two
        p.data_received(data[k : k + 7])
    assert [m["i"] for m in got] == list(range(50)) and p.pending() == 0 and not why
    p.data_received(data[:3])
    assert p.pending() == 3  # a partial header waits for the rest
    p.connection_lost(None)
    assert why == ["EOF"] and t.closed


def test_an_oversized_or_malformed_frame_closes_the_connection_once_with_a_reason():
    p, t, got, why = _proto()
    p.data_received((wire.MAX_FRAME + 1).to_bytes(4, "big"))
    assert t.closed and len(why) == 1 and "exceeds" in why[0] and got == []
    p.connection_lost(ConnectionResetError())
    assert len(why) == 1  # reported once
    p, t, got, why = _proto()
    p.data_received((5).to_bytes(4, "big") + b"{oops" + wire.encode({"type": "hb"}))
    assert t.closed and "malformed" in why[0] and got == []
