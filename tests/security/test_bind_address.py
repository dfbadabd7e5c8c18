"""Services bind to ``cluster.bind_host`` (default 127.0.0.1), never to all interfaces.

Checked from outside, on the live job's processes: every listening TCP socket a process holds,
from /proc/<pid>/fd and /proc/net/tcp{,6} (what ``ss -ltnp`` shows). The rendezvous store is
the coordinator's own (``rendezvous.StoreServer``, not torch's TCPStore) and binds like the rest.
"""

from __future__ import annotations

import socket
from typing import Optional

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]




def _other_interface_address() -> Optional[str]:
    """This machine's address on its default route (no packet is sent), or None without one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects the outgoing interface
        addr = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if addr.startswith("127.") else addr


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def test_coordinator_control_port_binds_to_the_configured_address(live_job):
    host, port = live_job.control
    assert host == "127.0.0.1", "the default cluster.bind_host is 127.0.0.1"
    listening = live_job.snapshot["coordinator"].listening
    assert (host, port) in listening, listening
    assert [a for a, p in listening if p == port] == ["127.0.0.1"]


def test_worker_sockets_bind_to_the_configured_address(live_job):
    """The state endpoint of every worker and spare, and gloo's listeners: 127.0.0.1 only."""
    ports = live_job.state_ports
    assert len(ports) == 3, ports  # 2 workers + 1 spare
    for wid, port in ports.items():
        listening = live_job.snapshot[wid].listening
        assert ("127.0.0.1", port) in listening, (wid, listening)
        assert all(addr == "127.0.0.1" for addr, _ in listening), f"{wid} listens beyond 127.0.0.1: {listening}"


def test_rendezvous_store_binds_to_the_configured_address(live_job):
    """The coordinator's rendezvous store (rendezvous.StoreServer) listens on cluster.bind_host."""
    _, control_port = live_job.control
    others = [(a, p) for a, p in live_job.snapshot["coordinator"].listening if p != control_port]
    assert len(others) == 1, others  # the rendezvous store
    assert others[0][0] == "127.0.0.1", others


def test_other_interfaces_reach_none_of_our_sockets(live_job):
    """From this machine's non-loopback address: control, state and store ports all refuse."""
    addr = _other_interface_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert live_job.running(), "the job ended before the check"
    _, control_port = live_job.control
    (store_port,) = [p for _, p in live_job.snapshot["coordinator"].listening if p != control_port]
    for name, port in [("control", control_port), ("store", store_port), *live_job.state_ports.items()]:
        assert not _reachable(addr, port), f"{name} port {port} accepts connections on {addr}"
