"""A worker whose control connection closed asks the coordinator's address before any last
resort (worker/last_resort.py): found by the Slurm chaos soak, where a killed slurmd made Slurm
end a node's srun while its worker lived on; the coordinator dropped that worker, which took
the closed connection for a dead coordinator and requeued the whole running job."""

from __future__ import annotations

import socket
import threading

import pytest

from ckptless_hpc.control import wire
from ckptless_hpc.worker.last_resort import coordinator_alive

pytestmark = pytest.mark.timeout(30)
SECRET = "s" * 32


def _server(secret: str):
    """A real listener doing the coordinator's side of the handshake; returns (address, what it received)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    got: list = []

    def serve() -> None:
        conn, _ = lsock.accept()
        try:
            wire.server_handshake(conn, secret)
            got.append(wire.recv_msg(conn))
        except (wire.ProtocolError, OSError) as e:
            got.append(e)
        finally:
            conn.close()
            lsock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{lsock.getsockname()[1]}", got, t


def test_a_live_coordinator_is_found_and_told_who_asks():
    address, got, t = _server(SECRET)
    assert coordinator_alive(address, SECRET, "n2.0", timeout_s=5) is True
    t.join(10)
    assert got and got[0]["type"] == "probe" and got[0]["worker"] == "n2.0"


def test_a_listener_without_the_job_secret_is_not_the_coordinator():
    address, _, t = _server("another job's secret, 32 chars..")
    assert coordinator_alive(address, SECRET, "n2.0", timeout_s=5) is False
    t.join(10)


def test_a_closed_port_is_a_gone_coordinator():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert coordinator_alive(f"127.0.0.1:{port}", SECRET, "n2.0", timeout_s=5) is False
