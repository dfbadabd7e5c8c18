"""The job's rendezvous store, authenticated: what every generation's group exchanges to form
(gloo's peer addresses, NCCL's unique id) goes through a key-value server in the coordinator
that accepts nothing before the peer proves it knows the job secret (the handshake of
:mod:`ckptless_hpc.control.wire`). torch's TCPStore has no authentication: anyone who could reach
its port could list, read and overwrite the job's keys and break every later generation.

``AuthStore`` is a ``torch.distributed.Store`` (the Python trampoline) over one authenticated
connection; groups use it like any store (``PrefixStore("gen<g>", store)``). Values travel as
base64 in the protocol's JSON frames; a blocking ``get``/``wait`` is answered when the key
exists or the timeout passes.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from . import wire
from .listener import Listener
from .messages import StoreAnswer, StoreRequest

log = logging.getLogger(__name__)
MAX_CLIENTS = 4096  # authenticated clients served at once
MAX_HANDSHAKES = 256  # connections in their handshake at once (listener.py: the oldest gives way)
HANDSHAKE_TIMEOUT_S = 10.0  # for the whole handshake


class StoreServer:
    """The coordinator's side: one thread per authenticated client, one dict, one condition."""

    def __init__(self, host: str, secret: str, on_reject: Optional[Any] = None) -> None:
        self._secret = secret
        self._data: Dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._sock = socket.create_server((host, 0), backlog=1024)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._on_reject = on_reject
        self._listener = Listener(self._sock, secret, self._serve, f"rendezvous store {host}:{self.port}", MAX_HANDSHAKES, MAX_CLIENTS, HANDSHAKE_TIMEOUT_S, self._reject)
        self._listener.start()  # once assigned: a handler may use it at once

    @property
    def rejected(self) -> int:
        """Connections refused: failed or unfinished handshakes, no slot free, bad requests."""
        return self._listener.rejected

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        """An authenticated client's requests, until it goes away (a retired generation's client)."""
        try:
            conn.settimeout(None)
            while True:
                req = wire.recv_msg(conn)
                wire.send_msg(conn, self._answer(req).encode())
        except (wire.ProtocolError, KeyError, TypeError, ValueError) as e:
            self._listener.reject(addr, str(e))
        except (ConnectionError, OSError):
            pass

    def _reject(self, addr: Any, why: str) -> None:
        log.warning("store request from %s rejected: %s", addr, why)
        if self._on_reject is not None:
            self._on_reject(addr, why)

    def _answer(self, req: Dict[str, Any]) -> StoreAnswer:
        """``req`` is read as it came (a missing or odd field: KeyError, TypeError, ValueError; the
        connection is rejected, as before the message classes): see ``StoreRequest``."""
        op = req["op"]
        with self._cv:
            if op == "set":
                self._data[req["key"]] = base64.b64decode(req["value"])
                self._cv.notify_all()
                return StoreAnswer(True)
            if op == "get" or op == "wait":
                keys = [req["key"]] if op == "get" else list(req["keys"])
                if not self._cv.wait_for(lambda: all(k in self._data for k in keys), float(req["timeout_s"])):
                    missing = [k for k in keys if k not in self._data]
                    return StoreAnswer(False, error=f"timed out after {req['timeout_s']}s waiting for {missing[:3]}")
                return StoreAnswer(True, base64.b64encode(self._data[keys[0]]).decode() if op == "get" else None)
            if op == "add":
                v = int(self._data.get(req["key"], b"0")) + int(req["amount"])
                self._data[req["key"]] = str(v).encode()
                self._cv.notify_all()
                return StoreAnswer(True, v)
            if op == "check":
                return StoreAnswer(True, all(k in self._data for k in req["keys"]))
            if op == "delete":
                return StoreAnswer(True, self._data.pop(req["key"], None) is not None)
            if op == "num_keys":
                return StoreAnswer(True, len(self._data))
            if op == "compare_set":
                cur, expected, desired = self._data.get(req["key"]), base64.b64decode(req["expected"]), base64.b64decode(req["desired"])
                if (cur is None and not expected) or cur == expected:
                    self._data[req["key"]] = desired
                    self._cv.notify_all()
                    cur = desired
                return StoreAnswer(True, base64.b64encode(cur if cur is not None else expected).decode())
        raise ValueError(f"unknown store operation {op!r}")

    def close(self) -> None:
        self._listener.close()


def _b(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class AuthStore(dist.Store):
    """A worker's client of the job's StoreServer (one authenticated connection)."""

    def __init__(self, host: str, port: int, secret: str, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._addr = f"{host}:{port}"
        self._sock: Optional[socket.socket] = None
        # paced: a connection refused by a store busy with strangers' handshakes is tried again
        self._sock = wire.connect_paced(host, port, secret, timeout_s=timeout_s, first_wait_s=min(10.0, timeout_s))

    def _call(self, **req: Any) -> Any:
        with self._lock:
            self._sock.settimeout(self._timeout_s + 10.0)  # the server answers a blocking get at its timeout
            wire.send_msg(self._sock, StoreRequest(**req).encode())
            ans = wire.recv_msg(self._sock)
        if not ans.get("ok"):
            raise RuntimeError(f"store {self._addr}: {req['op']} failed: {ans.get('error')}")
        return ans.get("value")

    def set(self, key: str, value: Any) -> None:
        self._call(op="set", key=key, value=base64.b64encode(_b(value)).decode())

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._call(op="get", key=key, timeout_s=self._timeout_s))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(op="add", key=key, amount=int(amount)))

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        t = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call(op="wait", keys=list(keys), timeout_s=t)

    def check(self, keys: List[str]) -> bool:
        return bool(self._call(op="check", keys=list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(op="delete", key=key))

    def num_keys(self) -> int:
        return int(self._call(op="num_keys"))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        v = self._call(op="compare_set", key=key, expected=base64.b64encode(_b(expected)).decode(), desired=base64.b64encode(_b(desired)).decode())
        return base64.b64decode(v)

    def close(self) -> None:
        sock = getattr(self, "_sock", None)  # absent when __init__ failed before it (dist.Store's own init)
        if sock is not None:
            sock.close()

    def __del__(self) -> None:
        self.close()
