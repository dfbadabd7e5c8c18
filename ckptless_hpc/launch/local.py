"""Local backend: a "node" is a group of worker processes on this machine (one process group).

Killing a node kills its process group, as losing a machine kills all its ranks. A failed node
is never reused: replacements start as new nodes with new names.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..coordinator.continuity import Identity, proc_identity
from ..protocol import SECRET_ENV
from .base import Launcher

ExitCallback = Callable[[str, int], None]


class LocalLauncher(Launcher):
    """Local processes: nothing waits for a scheduler (a kill is a signal, sent at once), and
    local nodes are never reused anyway (replacements get new names)."""

    def __init__(self, nodes: int, spare_nodes: int, max_refills: int, bind_host: str, threads: int, log_dir: str, secret: str,
                 relay_interval_s: Optional[float] = None) -> None:
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
        self.batch_node: Optional[str] = None  # the coordinator runs in this process, on no node
        os.makedirs(log_dir, exist_ok=True)

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str, secret: str) -> "LocalLauncher":
        c = cfg.cluster
        relay = float(c.heartbeat_interval_s) if c.control == "node" else None
        return cls(c.nodes, c.spare_nodes, c.max_refills, c.bind_host, cfg.train.threads, os.path.join(run_dir, "logs"), secret, relay)

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

    async def start_node(self, name: str, workers: int, coordinator: str, on_exit: ExitCallback) -> List[str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads))
        env[SECRET_ENV] = self.secret
        started = []
        pgid = 0  # the node's first process leads a new process group; the others join it
        via: List[str] = []
        if self.relay_interval_s is not None:  # the node's relay first (relay.py): the workers connect through it
            if self._relay_dir is None:
                self._relay_dir = tempfile.mkdtemp(prefix="ckptless-relay-")
            path = os.path.join(self._relay_dir, f"{name}.sock")
            argv = [sys.executable, "-m", "ckptless_hpc.relay", "--coordinator", coordinator, "--node", name, "--path", path, "--interval", str(self.relay_interval_s), "--host", self.bind_host]
            with open(os.path.join(self.log_dir, f"relay-{name}.log"), "ab") as out:
                proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env, process_group=0)
            self._relays[name] = proc
            pgid = proc.pid
            via = ["--relay", path]
        for j in range(workers):
            wid = f"{name}.{j}"
            argv = [sys.executable, "-m", "ckptless_hpc.worker", "--coordinator", coordinator, "--node", name, "--local-index", str(j), "--host", self.bind_host, *via]
            with open(self.log_path(wid), "ab") as out:
                proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env, process_group=pgid)
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
