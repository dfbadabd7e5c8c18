"""A live job to attack and inspect: started once (Popen, not blocking), shared by tests/security.

The job runs the default cluster config (bind_host 127.0.0.1) on the ``lm`` task, long enough
that the attacks of test_rogue_clients.py land while it trains. Everything is synchronised on
events.jsonl (polled with a deadline), never on sleeps.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
# ~30 ms/step unloaded, ~100 ms/step on a loaded 2-core machine: the attacks take ~8 s
OVERRIDES = ("task=lm", "train.steps=400")
SECRET_ENV = "CKPTLESS_SECRET"


def listening_sockets(pid: int) -> List[Tuple[str, int]]:
    """(address, port) of every listening TCP socket the process holds (from /proc, no ss needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, parse in (("/proc/net/tcp", _ipv4), ("/proc/net/tcp6", _ipv6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                addr, port = cols[1].split(":")
                found.append((parse(addr), int(port, 16)))
    return found


def _ipv4(hexaddr: str) -> str:
    return ".".join(str(b) for b in bytes.fromhex(hexaddr)[::-1])


def _ipv6(hexaddr: str) -> str:
    import ipaddress

    raw = b"".join(bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, 32, 8))
    return str(ipaddress.IPv6Address(raw))


def read_proc(pid: int, name: str) -> Optional[bytes]:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return None


@dataclass
class ProcInfo:
    pid: int
    cmdline: bytes
    environ: Optional[bytes]
    environ_mode: int
    environ_uid: int
    listening: List[Tuple[str, int]]


@dataclass
class LiveJob:
    run_dir: Path
    overrides: Tuple[str, ...]
    proc: Any = None
    nofile: Optional[int] = None  # RLIMIT_NOFILE (soft and hard) of the coordinator and so of its workers
    snapshot: Dict[str, ProcInfo] = field(default_factory=dict)  # "coordinator" / worker id -> info
    rc: Optional[int] = None

    # ----------------------------------------------------------------- process
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={self.run_dir}", *self.overrides]
        self._out = open(self.run_dir.parent / f"{self.run_dir.name}.out", "wb")
        limit = None if self.nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=limit)

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return (self.run_dir.parent / f"{self.run_dir.name}.out").read_text(errors="replace")[-4000:]

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout_s: float = 200) -> int:
        if self.rc is None:
            self.rc = self.proc.wait(timeout=timeout_s)
            self._out.close()
        return self.rc

    def kill(self) -> None:
        """Teardown after a failed test: end the coordinator and the workers it reported (by PID)."""
        pids = [self.proc.pid] + [e["pid"] for e in self.of("worker_connected")]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(timeout=30)

    def summary(self) -> Dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    def log(self, name: str = "coordinator") -> str:
        """A log of the run dir: ``coordinator`` or a worker id."""
        path = self.run_dir / ("coordinator.log" if name == "coordinator" else f"logs/{name}.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def ranks(self) -> Dict[int, str]:
        """rank -> worker of the first generation."""
        return {int(r): w for r, w in self.of("generation_started")[0]["ranks"].items()}

    def finished(self, timeout_s: float = 600) -> Dict[str, Any]:
        """The job_finished event (the job may take the time of a recovery or two to get there)."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = self.running()
            done = self.of("job_finished")
            if done:
                return done[0]
            if not running:
                raise AssertionError(f"job exited (rc {self.proc.returncode}) without a job_finished event:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not finish within {timeout_s}s:\n{self.output()}")
            time.sleep(0.1)

    # ----------------------------------------------------------------- events
    def events(self) -> List[Dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
        return out

    def of(self, kind: str) -> List[Dict[str, Any]]:
        return [e for e in self.events() if e["event"] == kind]

    def wait_for(self, what: str, cond: Callable[[List[Dict[str, Any]]], Any], timeout_s: float = 120) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = cond(self.events())
            if got:
                return got
            if not self.running():
                raise AssertionError(f"job exited (rc {self.proc.returncode}) before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s}s:\n{self.output()}")
            time.sleep(0.1)

    def wait_training(self) -> None:
        def ready(evs: List[Dict[str, Any]]) -> bool:
            started = [e for e in evs if e["event"] == "job_started"]
            if not started:
                return False
            n_active = started[0]["world"]
            n_spare = started[0]["spare_nodes"] * started[0]["workers_per_node"]
            kinds = [e["event"] for e in evs]
            return kinds.count("worker_ready") >= n_active and kinds.count("spare_ready") >= n_spare and "step" in kinds

        self.wait_for("all workers and spares ready and training started", ready, timeout_s=180)

    # ----------------------------------------------------------------- addresses
    @property
    def control(self) -> Tuple[str, int]:
        host, _, port = self.of("job_started")[0]["address"].rpartition(":")
        return host, int(port)

    @property
    def store(self) -> Tuple[str, int]:
        host, _, port = self.of("store_ready")[0]["address"].rpartition(":")
        return host, int(port)

    @property
    def coordinator_pid(self) -> int:
        return int(self.of("job_started")[0]["coordinator_pid"])

    @property
    def state_ports(self) -> Dict[str, int]:
        evs = self.of("worker_ready") + self.of("spare_ready")
        return {e["worker"]: int(e["state_port"]) for e in evs}

    @property
    def worker_pids(self) -> Dict[str, int]:
        return {e["worker"]: int(e["pid"]) for e in self.of("worker_connected")}

    def take_snapshot(self) -> None:
        """What the processes look like from outside while the job trains (cmdline, environ, sockets)."""
        procs = {"coordinator": self.coordinator_pid, **self.worker_pids}
        for name, pid in procs.items():
            st = os.stat(f"/proc/{pid}/environ")
            self.snapshot[name] = ProcInfo(pid, read_proc(pid, "cmdline") or b"", read_proc(pid, "environ"), st.st_mode & 0o777, st.st_uid, listening_sockets(pid))

    def secret(self) -> str:
        """The job's secret, read the way its own user can: /proc/<worker>/environ (see docs/security.md)."""
        for name, info in self.snapshot.items():
            if name != "coordinator" and info.environ:
                for var in info.environ.split(b"\0"):
                    if var.startswith(SECRET_ENV.encode() + b"="):
                        return var.split(b"=", 1)[1].decode()
        raise AssertionError(f"no {SECRET_ENV} in any worker's environment")


@pytest.fixture(scope="session")
def live_job(tmp_path_factory):
    job = LiveJob(tmp_path_factory.mktemp("security") / "run", OVERRIDES)
    job.start()
    try:
        job.wait_training()
        job.take_snapshot()
        yield job
    finally:
        if job.running():
            job.kill()


@pytest.fixture
def start_job(tmp_path):
    """Start a job of its own (``OVERRIDES`` plus ``extra``), wait until it trains; killed at teardown."""
    started: List[LiveJob] = []

    def start(*extra: str, nofile: Optional[int] = None) -> LiveJob:
        job = LiveJob(tmp_path / f"run{len(started)}", OVERRIDES + extra, nofile=nofile)
        started.append(job)
        job.start()
        job.wait_training()
        return job

    yield start
    for job in started:
        if job.running():
            job.kill()
