"""Local backend: a "node" is a group of worker processes on this machine (one process group).

Killing a node kills its process group, as losing a machine kills all its ranks. A failed node
is never reused: replacements start as new nodes with new names.

Workers are forked by the job's zygote (``worker/zygote.py``), which imported torch once;
``CKPTLESS_LOCAL_FORK=0`` starts each one as its own ``python -m ckptless_hpc.worker`` instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from ..coordinator.continuity import Identity, proc_identity
from ..control.wire import SECRET_ENV
from ..worker import zygote
from ..config import start_nodes
from ..rundir import paths
from . import worker_argv
from .base import ExitCallback

log = logging.getLogger(__name__)

FORK_ENV = "CKPTLESS_LOCAL_FORK"  # "0": no zygote, a process exec'd per worker
FORK_TIMEOUT_S = 120.0  # a worker the zygote has not forked by then is an error, not a wait
NO_FORK_HINT = f"HINT: {FORK_ENV}=0 starts each worker as its own process, without the zygote"


class Forked:
    """A worker forked by the zygote, as the launcher uses an ``asyncio.subprocess.Process``:
    ``pid``, ``returncode`` (None while alive), ``wait()``, ``send_signal()``."""

    def __init__(self, pid: int, exited: "asyncio.Future[Optional[int]]") -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self._exited = exited

    def _exit(self, rc: Optional[int]) -> None:
        if not self._exited.done():
            self.returncode = rc
            self._exited.set_result(rc)

    async def wait(self) -> Optional[int]:
        return await asyncio.shield(self._exited)  # a cancelled waiter leaves the others theirs

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)  # ProcessLookupError once it is gone, as asyncio's


class Zygote:
    """The launcher's end of the job's zygote: started at once (its torch import overlaps the
    coordinator's start-up), a request per worker, the replies read on the event loop."""

    def __init__(self, env: Dict[str, str], log_dir: str, target: Optional[str] = None) -> None:
        self.log = os.path.join(log_dir, paths.ZYGOTE_LOG)
        argv = worker_argv.zygote_command(zygote.TITLE_ROOM, target)  # target: the tests' fake worker
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                process_group=0,  # not in the coordinator's group: a Ctrl-C is the coordinator's to handle
            )
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._out, False)
        self._buf = b""
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._next = 0
        self._forks: Dict[int, "asyncio.Future[Forked]"] = {}  # request id -> its worker, once forked
        self._children: Dict[int, Forked] = {}
        self._pollers: List["asyncio.Future[None]"] = []  # exits watched from /proc once the zygote is lost
        self.lost: Optional[str] = None
        self._closing = False

    def _attach(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            loop.add_reader(self._out, self._readable)

    async def fork(self, argv: List[str], log_path: str, pgid: int, what: str) -> Forked:
        """Fork a worker with the worker arguments ``argv``, stdout and stderr to ``log_path``,
        leading a new process group (``pgid`` 0) or joining ``pgid``."""
        if self.lost:
            raise RuntimeError(f"cannot start {what}: {self.lost}")
        self._attach()
        assert self._loop is not None
        self._next += 1
        rid = self._next
        forked = self._forks[rid] = self._loop.create_future()
        try:
            os.write(self.proc.stdin.fileno(), zygote.encode({"id": rid, "argv": argv, "log": log_path, "pgid": pgid}))
            return await asyncio.wait_for(forked, FORK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"cannot start {what}: the worker zygote (pid {self.proc.pid}) did not fork it within {FORK_TIMEOUT_S:.0f}s; see {self.log}. {NO_FORK_HINT}"
            ) from None
        except BrokenPipeError:
            self._lose()
            raise RuntimeError(f"cannot start {what}: {self.lost}") from None
        finally:
            self._forks.pop(rid, None)

    def _readable(self) -> None:
        try:
            data = os.read(self._out, 65536)
        except BlockingIOError:
            return
        if not data:
            self._lose()
            return
        *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if "exit" in msg:
                child = self._children.pop(int(msg["exit"]), None)
                if child is not None:
                    child._exit(int(msg["rc"]))
            else:  # registered at once: its exit may follow in this very read
                pid, fut = int(msg["pid"]), self._forks.get(int(msg["id"]))
                if fut is None or fut.done():  # its start timed out: nobody would watch it
                    os.kill(pid, signal.SIGKILL)
                    continue
                child = self._children[pid] = Forked(pid, fut.get_loop().create_future())
                fut.set_result(child)

    def _lose(self) -> None:
        """The zygote is gone: said loudly; starts fail from now on, and the exits of the workers it
        forked are watched from /proc (their exit codes died with it)."""
        if self._loop is not None:
            self._loop.remove_reader(self._out)
        if self._closing or self.lost:
            return
        try:  # its pipe closed as it exited
            rc: Optional[int] = self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            rc = None
        self.lost = f"the worker zygote (pid {self.proc.pid}) exited unexpectedly (code {rc}); see {self.log}. {NO_FORK_HINT}"
        log.error("%s: no worker can be started any more", self.lost)
        for fut in self._forks.values():
            if not fut.done():
                fut.set_exception(RuntimeError(self.lost))
        self._pollers = [asyncio.ensure_future(self._poll_exit(child)) for child in self._children.values()]  # kept: the loop holds tasks weakly
        self._children.clear()

    @staticmethod
    async def _poll_exit(child: Forked) -> None:
        while proc_identity(child.pid) is not None:
            await asyncio.sleep(0.5)
        child._exit(None)

    async def close(self, timeout_s: float = 5.0) -> None:
        """EOF on its requests: it exits (killed if it has not after ``timeout_s``)."""
        self._closing = True
        if self._loop is not None:
            self._loop.remove_reader(self._out)
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            await asyncio.to_thread(self.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class LocalLauncher:
    """Local processes: nothing waits for a scheduler (a kill is a signal, sent at once), and
    local nodes are never reused anyway (replacements get new names). A ``base.Launcher``."""

    batch_node: Optional[str] = None  # the coordinator runs in this process, on no node
    node_is_one_step = False  # each worker is its own process: killing one leaves its node's others
    measures_identity = True  # from /proc

    def __init__(self, nodes: int, spare_nodes: int, max_refills: int, bind_host: str, threads: int, log_dir: str, secret: str, relay_interval_s: Optional[float] = None) -> None:
        self.nodes, self.spare_nodes, self.max_refills = nodes, spare_nodes, max_refills
        self.bind_host, self.threads, self.log_dir, self.secret = bind_host, threads, log_dir, secret
        self.relay_interval_s = relay_interval_s  # cluster.control=node: a relay process per node, summaries at this interval
        self._relay_dir: Optional[str] = None  # their sockets' directory: private (mkdtemp, 0700), made before any relay starts
        self._relays: Dict[str, Any] = {}  # node -> its relay process
        self._procs: Dict[str, Any] = {}
        self._launched: Dict[str, Optional[Identity]] = {}  # worker -> (pid, start ticks) at launch
        self._waiters: List["asyncio.Task[None]"] = []
        self._next = nodes + spare_nodes
        self.refills = 0
        os.makedirs(log_dir, exist_ok=True)
        self._zygote = Zygote(self._env(), log_dir) if os.environ.get(FORK_ENV, "1") != "0" else None

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str, secret: str) -> "LocalLauncher":
        c = cfg.cluster
        relay = float(c.heartbeat_interval_s) if c.control == "node" else None
        return cls(start_nodes(c), c.spare_nodes, c.max_refills, c.bind_host, cfg.train.threads, paths.RunPaths(run_dir).logs, secret, relay)

    def register(self, worker: str, hello: Dict[str, Any]) -> None:
        """Nothing to note: the launcher started the process itself."""

    def hold_commands(self) -> None:
        """No scheduler: a kill is a signal, sent at once."""

    def release_commands(self) -> None:
        """No scheduler: nothing was held."""

    def exclude_node(self, node: str, why: str) -> None:
        """Local nodes are never reused anyway (replacements get new names)."""

    def drained_nodes(self, nodes: List[str]) -> List[str]:
        """No scheduler marks local nodes (``ckptless-hpc drain`` does)."""
        return []

    def requeue(self, reason: str) -> Optional[str]:
        """None when requeued, else why not."""
        return "the local backend has no scheduler to requeue with (cluster=slurm can)"

    def initial_nodes(self, excluded: Any = ()) -> Tuple[List[str], List[str]]:
        active = [f"local{i}" for i in range(self.nodes)]
        spare = [f"local{self.nodes + i}" for i in range(self.spare_nodes)]
        return active, spare

    def free_node(self) -> Optional[str]:
        """A never-used node for a new spare, or None when the refill budget is spent."""
        if self.refills >= self.max_refills:
            return None
        self.refills += 1
        name = f"local{self._next}"
        self._next += 1
        return name

    def launched_identity(self, worker: str) -> Optional[Identity]:
        """(pid, start ticks) of the process this launcher started for ``worker``."""
        return self._launched.get(worker)

    def live_identity(self, worker: str) -> Optional[Identity]:
        """(pid, start ticks) of ``worker``'s process now, from /proc; None once it is gone."""
        proc = self._procs.get(worker)
        return None if proc is None or proc.returncode is not None else proc_identity(proc.pid)

    def log_path(self, worker: str) -> str:
        return os.path.join(self.log_dir, f"{worker}.log")

    def _env(self) -> Dict[str, str]:
        """The workers' environment (the zygote's too: a forked worker inherits it)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads))
        env[SECRET_ENV] = self.secret
        return env

    async def start_node(self, name: str, workers: int, coordinator: str, on_exit: ExitCallback) -> List[str]:
        env = self._env()
        started = []
        pgid = 0  # the node's first process leads a new process group; the others join it
        relay_path: Optional[str] = None
        if self.relay_interval_s is not None:  # the node's relay first (relay.py): the workers connect through it
            if self._relay_dir is None:
                self._relay_dir = tempfile.mkdtemp(prefix="ckptless-relay-")
            path = os.path.join(self._relay_dir, f"{name}.sock")
            argv = worker_argv.relay_command(coordinator, name, path, str(self.relay_interval_s), self.bind_host)
            with open(os.path.join(self.log_dir, f"relay-{name}.log"), "ab") as out:
                relay = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env, process_group=0)
            self._relays[name] = relay
            pgid, relay_path = relay.pid, path
        for j in range(workers):
            wid = f"{name}.{j}"
            args = worker_argv.worker_args(coordinator, name, str(j), self.bind_host, relay_path)
            if self._zygote is not None:
                proc: Any = await self._zygote.fork(args, self.log_path(wid), pgid, f"worker {wid} of node {name}")
            else:
                with open(self.log_path(wid), "ab") as out:
                    proc = await asyncio.create_subprocess_exec(
                        *worker_argv.worker_command(args), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env, process_group=pgid
                    )
            pgid = pgid or proc.pid
            self._procs[wid] = proc
            self._launched[wid] = proc_identity(proc.pid)
            self._waiters.append(asyncio.ensure_future(self._watch(wid, proc, on_exit)))
            started.append(wid)
        return started

    async def _watch(self, wid: str, proc: Any, on_exit: ExitCallback) -> None:
        rc = await proc.wait()
        on_exit(wid, rc)

    def pid(self, worker: str) -> Optional[int]:
        p = self._procs.get(worker)
        return p.pid if p else None

    def kill_worker(self, worker: str) -> None:
        p = self._procs.get(worker)
        if p is not None and p.returncode is None:
            try:
                p.send_signal(signal.SIGKILL)  # works on a stopped (hung) process too
            except ProcessLookupError:
                pass

    async def shutdown(self, timeout_s: float) -> None:
        """Wait for every worker to exit, then SIGKILL what is left."""
        live = [p for p in self._procs.values() if p.returncode is None]
        if live:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=timeout_s)
        for wid in list(self._procs):
            self.kill_worker(wid)
        for relay in self._relays.values():  # every worker is gone: so is the relays' purpose
            if relay.returncode is None:
                try:
                    relay.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
            await relay.wait()
        if self._relay_dir is not None:  # a killed relay leaves its socket behind
            shutil.rmtree(self._relay_dir, ignore_errors=True)
        for t in self._waiters:
            try:
                await asyncio.wait_for(t, timeout=5)
            except asyncio.TimeoutError:
                pass
        if self._zygote is not None:  # every worker is gone: so is the zygote's purpose
            await self._zygote.close()
