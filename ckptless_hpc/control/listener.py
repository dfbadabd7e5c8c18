"""A listening socket served one thread per connection (the rendezvous store, every worker's
state server), so that no stranger can end or wedge it:

- An ``accept()`` that fails while the listener is open (no descriptor left: EMFILE, ENFILE; no
  memory: ENOBUFS, ENOMEM; the peer gone: ECONNABORTED, EPROTO) is logged (the first at once,
  then at most once per ``LOG_EVERY_S`` with the count since) and retried after a pause that
  doubles from ``FIRST_PAUSE_S`` to ``MAX_PAUSE_S``; only ``close()`` ends the loop.
- A connection has ``handshake_s`` in all to authenticate (``wire.server_handshake``'s
  deadline: a peer dripping one byte at a time gets no more time than a silent one).
- At most ``preauth`` connections are in their handshake at once. A newcomer finding them all
  taken evicts the oldest if that one has had ``EVICT_AGE_S`` already: a drip or a half-open
  flood cannot keep out a peer that knows the secret (its handshake takes milliseconds). Else
  the newcomer is refused: a stranger reconnecting as soon as it is evicted cannot evict in turn
  the peer that just took its slot, and a peer refused in a burst of its own kind retries
  (``wire.connect_paced``, a fetch's next attempt).
- At most ``authed`` authenticated connections are served at once; one more is refused.

Every refusal reaches ``on_reject(addr, why)`` (the caller counts, logs and reports it) and
``rejected``. Decisions about what a connection asks for are the handler's.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

from . import wire

log = logging.getLogger(__name__)

FIRST_PAUSE_S = 0.01
MAX_PAUSE_S = 1.0
EVICT_AGE_S = 1.0
LOG_EVERY_S = 10.0
_CLOSED = (errno.EBADF, errno.EINVAL, errno.ENOTSOCK)  # accept() on a listener closed or shut down

Handler = Callable[[socket.socket, Any], None]
OnReject = Callable[[Any, str], None]


def accept_pause_s(failures: int) -> float:
    """The pause after the ``failures``-th accept error in a row (pure)."""
    return min(MAX_PAUSE_S, FIRST_PAUSE_S * (2 ** min(failures, 30)))


class Throttle:
    """Says whether to log now: the first time, then at most once per ``every_s`` (the count of
    the ones held back goes with it). ``now`` is passed in."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last: Optional[float] = None
        self._held = 0

    def due(self, now: float) -> Optional[int]:
        """None: stay quiet; else how many were held back since the last one logged."""
        if self._last is not None and now - self._last < self.every_s:
            self._held += 1
            return None
        held, self._held, self._last = self._held, 0, now
        return held


class Listener:
    """Serves ``sock`` (listening) with ``handle(conn, addr)`` on authenticated connections.
    ``what`` names it in every log line ("rendezvous store 127.0.0.1:4242")."""

    def __init__(self, sock: socket.socket, secret: str, handle: Handler, what: str, preauth: int, authed: int, handshake_s: float, on_reject: Optional[OnReject] = None) -> None:
        self._sock, self._secret, self._handle, self.what = sock, secret, handle, what
        self.preauth, self.authed, self.handshake_s = preauth, authed, handshake_s
        self._on_reject = on_reject
        self._lock = threading.Lock()
        self._pending: "OrderedDict[socket.socket, float]" = OrderedDict()  # in their handshake (since when), oldest first
        self._evicted: Dict[socket.socket, str] = {}
        self._serving = 0
        self._closed = False
        self.rejected = 0
        self.accept_errors = 0
        self._throttle = Throttle()

    def start(self) -> "Listener":
        threading.Thread(target=self._accept_loop, name=f"accept {self.what}", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop accepting (wakes the accept loop, which then returns)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    # ---------------------------------------------------------------- accepting
    def _accept_loop(self) -> None:
        failures = 0
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno in _CLOSED:
                    return
                failures += 1
                self._accept_failed(e, failures)
                time.sleep(accept_pause_s(failures))
                continue
            if failures:
                log.warning("%s: accepting again after %d failed accept()s", self.what, failures)
                failures = 0
            refused = self._admit(conn)
            if refused is not None:
                conn.close()
                self.reject(addr, refused)
                continue
            try:
                threading.Thread(target=self._run, args=(conn, addr), name=f"conn {self.what}", daemon=True).start()
            except RuntimeError as e:  # no thread to be had (the process's limit): this one waits no more, the loop goes on
                with self._lock:
                    self._pending.pop(conn, None)
                conn.close()
                self.reject(addr, f"no thread to serve it: {e}")
                failures += 1
                time.sleep(accept_pause_s(failures))

    def _accept_failed(self, e: OSError, failures: int) -> None:
        self.accept_errors += 1
        held = self._throttle.due(time.monotonic())
        if held is None:
            return
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        log.error(
            "%s: accept() failed (%s: %s; %d in a row, %d not logged since the last line): retrying in %.2fs. "
            "HINT: EMFILE/ENFILE mean no file descriptor is left (ulimit -n, or many connections held open by someone)",
            self.what,
            name,
            e.strerror,
            failures,
            held,
            accept_pause_s(failures),
        )

    def _admit(self, conn: socket.socket) -> Optional[str]:
        """A new connection takes a handshake slot: a free one, or the oldest one's if that one
        is old enough; else why it is refused."""
        now = time.monotonic()
        with self._lock:
            if len(self._pending) >= self.preauth:
                oldest, t0 = next(iter(self._pending.items()))
                if now - t0 < EVICT_AGE_S:
                    return f"{self.preauth} handshakes already in progress, the oldest for {now - t0:.2f}s only"
                del self._pending[oldest]
                self._evicted[oldest] = f"evicted after {now - t0:.2f}s without finishing its handshake ({self.preauth} handshakes in progress, a newcomer waiting)"
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread wakes, finds it evicted, reports and closes it
                except OSError:
                    pass
            self._pending[conn] = now
        return None

    # ---------------------------------------------------------------- one connection
    def _run(self, conn: socket.socket, addr: Any) -> None:
        try:
            if not self._authenticate(conn, addr):
                return
            try:
                self._handle(conn, addr)
            finally:
                with self._lock:
                    self._serving -= 1
        finally:
            conn.close()

    def _authenticate(self, conn: socket.socket, addr: Any) -> bool:
        try:
            wire.server_handshake(conn, self._secret, timeout_s=self.handshake_s)
            why = None
        except (wire.ProtocolError, OSError) as e:
            why = str(e) or type(e).__name__
            if isinstance(e, ConnectionError):
                why = f"connection closed before authentication ({type(e).__name__}: {why})"
        with self._lock:
            self._pending.pop(conn, None)
            evicted = self._evicted.pop(conn, None)
            if why is None and evicted is None:
                if self._serving < self.authed:
                    self._serving += 1
                    return True
                why = f"{self.authed} authenticated connections already open"
        self.reject(addr, evicted or why or "")
        return False

    def reject(self, addr: Any, why: str) -> None:
        """Count a refusal and report it (the handler's too: a bad request after the handshake)."""
        self.rejected += 1
        if self._on_reject is not None:
            self._on_reject(addr, why)
