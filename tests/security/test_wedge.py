"""A stranger without the secret tries to end or wedge a live job (real processes, real sockets,
real signals); a rank is then killed, and the job must still recover and end ``completed`` with
the fault-free run's final hash (the oracle), or, cancelled, end at once.

- EMFILE: under a lowered RLIMIT_NOFILE, half-open connections to the rendezvous store until its
  accept() fails for want of a descriptor, closed again before the fault: the store's accept
  loop must survive (it used to return for good, and the job re-formed every 60 s forever).
- Drip: connections that send one byte every 2 s, holding every handshake slot of the survivor's
  state port and of the store (under the common ``ulimit -n 1024``) while the spare fetches its
  state and the generation forms: the spare's fetch must succeed (it used to be refused three
  times, the spare blamed and excluded, the job ended no_spare).
- Cancel: SIGTERM to the coordinator while a recovery waits for a survivor that never answers
  must end the job (cancelled, exit 6) without waiting out the recovery.
"""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import struct
import threading
import time
from typing import List

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]  # minutes on a loaded 2-core machine; ~30 s each unloaded

FLOOD_MAX = 4000  # connections the EMFILE flood may open in all (the store closes unfinished handshakes after 10 s)
DRIP_EVERY_S = 2.0  # well inside any per-read timeout: only a bound on the whole handshake ends a drip


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the listener on ``port`` (/proc/net/tcp's
    rx_queue of a LISTEN socket)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "0A" and int(cols[1].split(":")[1], 16) == port:
            return int(cols[4].split(":")[1], 16)
    return 0


def _kill_rank(job, rank: int, sig: int = signal.SIGKILL) -> None:
    os.kill(job.worker_pids[job.ranks()[rank]], sig)


def _recovered_to_the_oracle(job, baseline) -> None:
    end = job.finished()
    assert end["status"] == "completed", (end, job.output())
    assert job.finish() == 0
    s = job.summary()
    assert len(s["recoveries"]) == 1 and s["steps_completed"] == s["steps_requested"], s
    assert s["final_state_sha256"] == baseline(*job.overrides)


class Drip:
    """``n`` connections to ``addr`` that announce a frame of 1,000 bytes (within the 1 KiB a
    stranger may send), then send its bytes one every DRIP_EVERY_S, all from one thread; ``persistent``: one the server closes is opened again at
    once (every slot stays taken), else it is left closed."""

    def __init__(self, addr, n: int, persistent: bool) -> None:
        raise_own_fd_limit(n + 64)
        self.addr, self.persistent = addr, persistent
        self.sel = selectors.DefaultSelector()
        for _ in range(n):
            self._open()
        self.sent = self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        s = socket.create_connection(self.addr, timeout=30)
        s.sendall(struct.pack(">I", 1000))
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ)

    def _run(self) -> None:
        next_drip = time.monotonic() + DRIP_EVERY_S
        while not self._stop.is_set() and self.sel.get_map():
            for key, _ in self.sel.select(max(0.0, next_drip - time.monotonic())):
                try:
                    if key.fileobj.recv(4096):
                        continue  # the challenge
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._gone(key.fileobj)
            if time.monotonic() >= next_drip:
                next_drip += DRIP_EVERY_S
                for key in list(self.sel.get_map().values()):
                    try:
                        key.fileobj.send(b" ")
                        self.sent += 1
                    except OSError:
                        self._gone(key.fileobj)

    def _gone(self, s: socket.socket) -> None:
        self.sel.unregister(s)
        s.close()
        if self.persistent and not self._stop.is_set():
            try:
                self._open()
                self.reopened += 1
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()


def raise_own_fd_limit(n: int) -> None:
    """This process holds ``n`` connections: its soft RLIMIT_NOFILE up to its hard one if need be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


def test_emfile_on_the_store_is_survived_and_a_fault_recovers(start_job, baseline):
    limit = 64  # the coordinator holds ~15 descriptors while it trains (3 workers)
    job = start_job(nofile=limit)
    pid, port = job.coordinator_pid, job.store[1]
    raise_own_fd_limit(FLOOD_MAX + 64)
    flood: List[socket.socket] = []
    deadline = time.monotonic() + 300
    # every descriptor taken and connections left waiting: the store's next accept() fails with
    # EMFILE. Paced by the accept queue, not by a count: on a loaded machine the coordinator's
    # accept() lags far behind connect() (the kernel completes a connection before it is accepted)
    while not (_fds(pid) >= limit and _accept_queue(port) > 0):
        assert time.monotonic() < deadline and len(flood) < FLOOD_MAX, (
            f"the coordinator holds {_fds(pid)} descriptors, {_accept_queue(port)} queued, after {len(flood)} connections"
        )
        if _accept_queue(port) < 8:
            flood.append(socket.create_connection(job.store, timeout=30))
        else:
            time.sleep(0.01)  # the store is still accepting what is queued
    job.wait_for("the store's accept() failing with EMFILE", lambda _: "accept() failed (EMFILE" in job.log(), timeout_s=120)
    for s in flood:
        s.close()
    _kill_rank(job, 0)
    _recovered_to_the_oracle(job, baseline)
    assert "rendezvous store 127.0.0.1:%d: accept() failed (EMFILE" % port in job.log()


def test_a_drip_on_the_survivors_state_port_and_on_the_store_does_not_stop_the_recovery(start_job, baseline):
    from ckptless_hpc.control.rendezvous import MAX_HANDSHAKES as STORE_HANDSHAKES
    from ckptless_hpc.state.transfer import MAX_HANDSHAKES as STATE_HANDSHAKES

    job = start_job(nofile=1024)  # the common ulimit -n, which raise_fd_limit leaves alone for a small job
    survivor = job.ranks()[1]
    state = Drip(("127.0.0.1", job.state_ports[survivor]), STATE_HANDSHAKES, persistent=True)  # every slot of the source, all the time
    store = Drip(job.store, 1100, persistent=False)  # more than the store's handshake slots, and than its descriptors
    try:
        job.wait_for("a drip sent on every connection", lambda _: state.sent >= STATE_HANDSHAKES, timeout_s=60)
        _kill_rank(job, 0)
        _recovered_to_the_oracle(job, baseline)
    finally:
        state.close()
        store.close()
    assert not job.of("no_spare") and len(job.of("spare_promoted")) == 1
    assert "evicted" in job.log(survivor), "the drip on the source was never evicted: it did not hold its slots"
    turned_away = [e for e in job.of("connection_rejected") if e.get("port") == "store" and "handshakes" in e["error"]]  # evicted, or refused when full
    assert len(turned_away) >= 1100 - STORE_HANDSHAKES, f"only {len(turned_away)} store connections turned away for want of a handshake slot"


def test_a_cancel_does_not_wait_for_a_recovery_stuck_on_a_survivor(start_job):
    """The survivor is stopped (SIGSTOP) and the bounds are long: the recovery would wait 600 s
    for it to hold; SIGTERM, the documented cancel, ends the job now."""
    job = start_job("cluster.heartbeat_timeout_s=600", "cluster.recovery_timeout_s=600")
    survivor = job.worker_pids[job.ranks()[1]]
    os.kill(survivor, signal.SIGSTOP)
    try:
        _kill_rank(job, 0)
        job.wait_for("the recovery to start", lambda evs: any(e["event"] == "generation_bumped" for e in evs))
        os.kill(job.coordinator_pid, signal.SIGTERM)
        end = job.finished(timeout_s=120)
        assert end["status"] == "cancelled" and end["exit_code"] == 6, end
        assert job.finish(timeout_s=120) == 6
    finally:
        try:
            os.kill(survivor, signal.SIGCONT)
        except ProcessLookupError:
            pass
