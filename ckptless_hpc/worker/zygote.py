"""The local backend's fork server ("zygote"): imports torch and the worker once, then forks workers.

Why: every worker process used to be ``python -m ckptless_hpc.worker``, and importing torch
costs it ~2.7 CPU-seconds before it says hello; a short local job (the tests) spent most of its
time starting 3-7 of them on a few cores. The zygote pays the import once per job, and each
worker is a fork of it: still a real process with its own PID, in its node's process group,
killed by real signals, its exit status reported as before (``launch/local.py``).

Wire (newline-delimited JSON on pipes):

- launcher -> zygote (its stdin): ``{"id", "argv": [worker arguments], "log": path, "pgid"}``;
  ``pgid`` 0: the worker leads a new process group (its node's), else it joins that group;
- zygote -> launcher (its stdout): ``{"id", "pid"}`` once forked; ``{"exit": pid, "rc"}`` once
  reaped, rc as asyncio reports it (the exit code, or -signum when a signal killed it);
- EOF on its stdin (the coordinator is gone or done): the zygote exits. It kills no worker:
  a worker that loses its coordinator exits by itself (``Agent._on_lost``, worker/agent.py).

Fork-safety: before a fork the zygote runs no torch op (no OpenMP/intra-op pool exists yet),
initializes no CUDA and starts no thread; it waits in ``select`` on its requests and on a
SIGCHLD wake-up pipe instead. The child sets everything up as a fresh worker process would have
it, and always leaves through ``os._exit``: it never returns into the zygote's loop.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, NoReturn, Optional

WORKER = "ckptless_hpc.worker.runtime:main"
# imported by every worker later anyway, so imported once here: torch.optim's first param group
# imports torch._dynamo (~1.5 CPU-s, sympy included); the worker's _build imports hydra.utils
PRELOAD = ("torch._dynamo", "hydra.utils")
# the zygote's last argument: room in its argv area for a worker's command line (retitle below)
TITLE_ROOM = " " * 1024


def encode(msg: Dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def returncode(status: int) -> int:
    """A ``waitpid`` status as asyncio's ``Process.returncode``: exit code, or -signum."""
    return os.waitstatus_to_exitcode(status)


def retitle(argv: List[str]) -> bool:
    """Write ``argv`` over this process's original argv area, so that /proc/<pid>/cmdline (what
    ``ps``, ``ckptless_hpc.tools.commands`` and the benchmarks read) names the worker and its coordinator,
    as the command line of an exec'd worker did. What does not fit is cut; the area's last byte
    stays NUL, or the kernel would read on into the environment (where the secret is)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
    except (OSError, IndexError, ValueError):
        return False
    room = end - start
    if start == 0 or room < 2:
        return False
    data = b"\0".join(a.encode() for a in argv)[: room - 1]
    ctypes.memmove(start, data.ljust(room, b"\0"), room)
    return True


def exit_now(code: int = 0) -> NoReturn:
    """Leave without the interpreter's finalization: with torch, torch._dynamo and sympy loaded it
    takes 2-5 CPU-seconds (measured against ``os._exit`` after the same imports), longer than the
    launcher's close waits on a loaded 2-core machine, and the zygote has nothing to save."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _child(req: Dict[str, Any], target: Callable[[List[str]], Any], close: List[int]) -> NoReturn:
    """A forked worker: its own stdio, process group and signal dispositions, then the worker's
    ``main``; whatever happens, it ends here with ``os._exit``."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in [out, null, *close]:
            if fd > 2:
                os.close(fd)
        os.setpgid(0, int(req.get("pgid") or 0))  # EPERM: the node's group is gone (its node was killed)
        argv = [str(a) for a in req["argv"]]
        sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py"), *argv]
        retitle([sys.executable, "-m", "ckptless_hpc.worker", *argv])
        target(argv)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported in the worker's log, then the process ends
        traceback.print_exc()
    finally:
        exit_now(code)


def serve(target: Callable[[List[str]], Any], requests: int, replies: int) -> None:
    """Fork a worker per request until ``requests`` reaches EOF; report each child's exit."""
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a Python handler: the C one writes the wake-up byte
    signal.set_wakeup_fd(wake_w)
    buf = b""
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            _reap(replies)
        if requests not in ready:
            continue
        data = os.read(requests, 65536)
        if not data:
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            req = json.loads(line)
            pgid = int(req.get("pgid") or 0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req, target, [requests, replies, wake_r, wake_w])
            try:  # as shells do: whichever of parent and child runs first puts it in its group
                os.setpgid(pid, pgid or pid)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.ESRCH, errno.EPERM):
                    raise
            os.write(replies, encode({"id": req.get("id"), "pid": pid}))


def _reap(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(replies, encode({"exit": pid, "rc": returncode(status)}))


def _load(spec: str) -> Callable[[List[str]], Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: Optional[List[str]] = None) -> None:
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a.strip()]  # TITLE_ROOM is blank
    # the replies get a descriptor of their own: a stray print of an import lands in the log, not in the wire
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    t0 = time.monotonic()
    # --target MODULE:FUNCTION: what a child runs (the tests' small fake worker); the worker's main by default
    spec = args[args.index("--target") + 1] if "--target" in args else WORKER
    target = _load(spec)
    if spec == WORKER:
        for module in PRELOAD:
            importlib.import_module(module)
    retitle([sys.executable, "-m", "ckptless_hpc.worker.zygote", *args])  # the blank room is not shown
    print(f"zygote: pid {os.getpid()} imported {spec} in {time.monotonic() - t0:.2f}s; forking workers", file=sys.stderr)
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:  # an import started one: a forked child would hold a copy of its locks, not the thread
        print(f"zygote: WARNING: {threads} threads after importing {target.__module__}; forking is not safe", file=sys.stderr)
    try:
        serve(target, requests, replies)
    except BrokenPipeError:  # the launcher is gone
        pass


if __name__ == "__main__":
    main()
    exit_now()
