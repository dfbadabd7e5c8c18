"""The project's Slurm mini-cluster from Python (tests/slurm_cluster/up.sh and down.sh):
start it, crash a node, kill a node's slurmd alone, bring nodes back, wait for all idle.

Used by the real-Slurm tests (through tests/slurm_cluster/fixture.py, which adds the skip
policy) and by ``python -m ckptless_hpc.chaos cluster=slurm``. It needs a source checkout (the
scripts live in tests/slurm_cluster) and root (the daemons run as root and munge).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from . import commands

SCRIPTS = Path(__file__).resolve().parents[2] / "tests" / "slurm_cluster"
UP_TIMEOUT_S = 900.0  # a fresh machine runs apt-get update + install first
NODE_TIMEOUT_S = 90.0


class ClusterError(RuntimeError):
    """The mini-cluster cannot be started or changed; the message says why and what to do."""


def script(name: str) -> Path:
    path = SCRIPTS / name
    if not path.is_file():
        raise ClusterError(f"{path} not found: the Slurm mini-cluster's scripts ship with the source checkout only. HINT: run from a clone of the repository")
    return path


def cluster_dir() -> Path:
    """The state dir up.sh uses (``CKPTLESS_SLURM_DIR``, default /tmp/ckptless-slurm)."""
    return Path(os.environ.get("CKPTLESS_SLURM_DIR", "/tmp/ckptless-slurm"))


def ensure_cluster(nodes: int = 4) -> Dict[str, str]:
    """Start the cluster with ``nodes`` nodes (idempotent); return the env vars to use it
    (at least ``SLURM_CONF``; lay them over ``os.environ`` for Slurm commands)."""
    if os.geteuid() != 0:
        raise ClusterError("needs root to start the Slurm mini-cluster (tests/slurm_cluster/up.sh). HINT: run as root, or deselect the Slurm tests with -m 'not slurm'")
    rc, output = run_script([str(script("up.sh")), str(nodes)], UP_TIMEOUT_S)
    if rc != 0:
        raise ClusterError(f"`bash {script('up.sh')} {nodes}` failed (rc={rc}); its output:\n{output}")
    return read_env_sh(cluster_dir() / "env.sh")


def crash_node(*names: str) -> str:
    """Hard failure of these nodes, in one instant: SIGKILL their slurmd, slurmstepd's and tasks."""
    return _must_run([str(script("down.sh")), "--crash-node", *names], NODE_TIMEOUT_S)


def kill_slurmd(name: str) -> str:
    """SIGKILL the node's slurmd alone: its steps' processes live on, Slurm loses the node."""
    return _must_run([str(script("down.sh")), "--kill-slurmd", name], NODE_TIMEOUT_S)


def start_node(*names: str) -> str:
    """(Re)start these nodes' slurmd (a live one is left alone); returns once they respond."""
    return _must_run([str(script("up.sh")), "--start-node", *names], NODE_TIMEOUT_S)


def stop_cluster() -> str:
    """Cancel all jobs and stop every daemon up.sh started (down.sh)."""
    return _must_run([str(script("down.sh"))], UP_TIMEOUT_S)


def node_states(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """node -> Slurm state (idle, mixed, down*, drained, ...), one sinfo call."""
    out = commands.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env).stdout
    return dict(line.split(None, 1) for line in out.splitlines() if line.strip())


def restore(nodes: List[str], within_s: float = 60.0, env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Bring every node back to idle: restart a dead slurmd, resume a node downed or drained
    by a job (a drain is kept by Slurm until told). Call it with no job running. Returns
    the states once all are idle; ClusterError naming the others after ``within_s``."""
    deadline = time.monotonic() + within_s
    start_node(*nodes)  # a crashed node looks idle for ~20 s: restart every dead slurmd first
    while True:
        states = node_states(env)
        bad = [n for n in nodes if states.get(n) != "idle"]
        if not bad:
            return states
        if time.monotonic() > deadline:
            raise ClusterError(
                f"nodes not idle after {within_s:.0f} s: { ({n: states.get(n) for n in bad}) }. HINT: see {cluster_dir()}/log, or restart with tests/slurm_cluster/down.sh and up.sh 4"
            )
        for n in bad:
            st = states.get(n, "")
            if "*" in st or st.startswith("unk"):  # its slurmd does not answer
                start_node(n)  # ReturnToService=2: idle as soon as it registers
            elif st.startswith(("drain", "down")):
                commands.run(["scontrol", "update", f"nodename={n}", "state=resume"], env=env)
        time.sleep(0.5)


def read_env_sh(path: Path) -> Dict[str, str]:
    """``export KEY=VALUE`` lines of up.sh's env.sh as a dict."""
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export ") :].split("=", 1)
            env[key.strip()] = value.strip()
    if "SLURM_CONF" not in env:
        raise ClusterError(f"{path} exports no SLURM_CONF. HINT: rerun {SCRIPTS / 'up.sh'}")
    return env


def _must_run(argv: List[str], timeout_s: float) -> str:
    rc, output = run_script(argv, timeout_s)
    if rc != 0:
        raise ClusterError(f"`bash {' '.join(argv)}` failed (rc={rc}); its output:\n{output}")
    return output


def run_script(argv: List[str], timeout_s: float) -> "tuple[int, str]":
    """Run a cluster script; output goes to a file, not a pipe: the daemons it starts
    must not hold our pipe open (we would wait for their exit)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            rc = subprocess.run(["bash", *argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        out.seek(0)
        text = out.read()
    if rc == 124:
        text += f"\n(timed out after {timeout_s} s)"
    return rc, text[-8000:]
