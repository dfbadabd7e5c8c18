"""The coordinator's host settings: listen queue depth, bytes waiting unread, file limit."""

from __future__ import annotations

import resource
import socket

import pytest

from ckptless_hpc.coordinator import host

pytestmark = pytest.mark.timeout(10)


def test_listen_backlog_follows_somaxconn(tmp_path):
    f = tmp_path / "somaxconn"
    f.write_text("4096\n")
    assert host.listen_backlog(str(f)) == 4096
    f.write_text("1000000\n")
    assert host.listen_backlog(str(f)) == 65535
    assert host.listen_backlog(str(tmp_path / "missing")) == 4096


class _Writer:
    def __init__(self, sock):
        self.sock = sock

    def get_extra_info(self, name):
        return self.sock if name == "socket" else None


def test_bytes_waiting_in_the_kernel_are_seen_on_a_real_socket():
    a, b = socket.socketpair()
    try:
        assert host.kernel_unread(_Writer(b)) == 0
        a.sendall(b"x" * 100)
        b.settimeout(2)
        b.recv(1, socket.MSG_PEEK)  # delivered
        assert host.kernel_unread(_Writer(b)) == 100
        assert host.kernel_unread(None) == 0
    finally:
        a.close()
        b.close()


def test_the_file_limit_is_raised_only_as_far_as_allowed():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    host.raise_fd_limit(10)  # already enough: nothing changes
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
