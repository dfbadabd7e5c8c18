"""The worker's end of the control channel: one socket, a reader thread, a heartbeat thread."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional, Union

from . import messages, wire

log = logging.getLogger(__name__)


class ControlClient:
    """Sends messages (thread-safe) and queues what the coordinator says.

    ``on_message`` runs in the reader thread for every message before it is queued, so an
    abort can wake a main thread that is blocked in a collective. Losing the coordinator calls
    ``on_lost`` (the worker then exits: a worker never outlives its job's coordinator).
    """

    def __init__(self, sock: socket.socket, on_message: Callable[[Dict[str, Any]], None], on_lost: Callable[[str], None]) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._on_message = on_message
        self._on_lost = on_lost
        self.inbox: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.heartbeat_fields: Callable[[], Dict[str, Any]] = lambda: {}
        threading.Thread(target=self._read_loop, name="control-reader", daemon=True).start()

    @classmethod
    def connect(cls, address: str, secret: str, **kw: Any) -> "ControlClient":
        """``address``: HOST:PORT of the coordinator, or the path of the node's relay socket."""
        if address.startswith("/"):
            return cls(wire.connect_unix(address, secret), **kw)
        host, _, port = address.rpartition(":")
        return cls(wire.connect_paced(host, int(port), secret), **kw)

    def fileno(self) -> int:
        """The control socket's descriptor (a forked child must close its copy)."""
        return self._sock.fileno()

    def send(self, msg: Union[Dict[str, Any], "messages.Encodable"]) -> None:
        """``msg``: a message of control/messages.py, or its encoded dict; ``t`` (when it was sent) is added."""
        if not isinstance(msg, dict):
            msg = msg.encode()
        msg.setdefault("t", time.time())
        data = wire.encode(msg)
        try:
            with self._lock:
                self._sock.sendall(data)
        except OSError as e:
            self._on_lost(f"send failed: {e}")

    def start_heartbeats(self, interval_s: float) -> None:
        def beat() -> None:
            while True:
                self.send(messages.heartbeat(**self.heartbeat_fields()))
                time.sleep(interval_s)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _read_loop(self) -> None:
        try:
            while True:
                msg = wire.recv_msg(self._sock)
                self._on_message(msg)
                self.inbox.put(msg)
        except (OSError, ConnectionError, wire.ProtocolError) as e:
            self._on_lost(f"control channel closed: {e}")

    def next_message(self, timeout_s: Optional[float] = None) -> Optional[Dict[str, Any]]:
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None


def exit_now(code: int) -> None:
    """Leave without running finalizers: an abandoned process group may hold threads forever."""
    logging.shutdown()
    os._exit(code)
