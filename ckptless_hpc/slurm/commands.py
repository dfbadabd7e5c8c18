"""Thin subprocess wrappers over squeue/scontrol/sinfo: the project's Slurm I/O.

Every call has a timeout; every failure names the command, its exit code and stderr.
``env`` (optional) is laid over ``os.environ`` for the child, e.g. ``{"SLURM_CONF": ...}``.
Argv comes from ``render``; parsing of the output is kept in small pure helpers.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence

from ckptless_hpc.slurm import render
from ckptless_hpc.slurm.env import expand_nodelist

DEFAULT_TIMEOUT_S = 10.0
_INVALID_JOB = "Invalid job id"


class SlurmCommandError(RuntimeError):
    """A Slurm command failed, timed out or was not found."""

    def __init__(self, argv: Sequence[str], message: str, returncode: int | None = None, stderr: str = "") -> None:
        super().__init__(f"`{shlex.join(argv)}` {message}")
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr


def run(argv: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run one Slurm command; raise `SlurmCommandError` unless it exits 0."""
    child_env = None if env is None else {**os.environ, **env}
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=child_env, stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise SlurmCommandError(argv, f"failed: {argv[0]} not found. HINT: install the Slurm client tools or put them on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(argv, f"timed out after {timeout_s} s. HINT: is slurmctld overloaded or down? check `scontrol ping`") from None
    if done.returncode != 0:
        stderr = done.stderr.strip()
        detail = stderr or done.stdout.strip() or "(no output)"
        raise SlurmCommandError(argv, f"exited {done.returncode}: {detail}", done.returncode, stderr)
    return done


def live_nodes(job_id: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> list[str]:
    """The nodes the job holds now (one squeue call); [] while pending.

    Unlike SLURM_JOB_NODELIST this drops nodes lost or downed since the job started.
    """
    done = run(render.squeue_nodes_argv(job_id), timeout_s=timeout_s, env=env)
    return expand_nodelist(done.stdout.strip())


def drained_nodes(nodes: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> list[str]:
    """Those of NODES whose state says drain (draining, drained, mixed+drain...): one sinfo call."""
    if not nodes:
        return []
    done = run(render.sinfo_states_argv(nodes), timeout_s=timeout_s, env=env)
    return sorted({n for n, state in (line.split()[:2] for line in done.stdout.splitlines() if len(line.split()) >= 2) if "drain" in state.lower()})


def down_node(node: str, reason: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
    """Set NODE down now: its steps end at once and it leaves every running job."""
    run(render.scontrol_down_argv(node, reason), timeout_s=timeout_s, env=env)


def drain_node(node: str, reason: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
    """Drain NODE: Slurm places no new job (our requeued one included) on it."""
    run(render.scontrol_drain_argv(node, reason), timeout_s=timeout_s, env=env)


def cancel_step(job_id: str, step_id: int, *, signal: str = "KILL", timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
    """Signal every task of step JOB.STEP (SIGKILL by default)."""
    run(render.scancel_step_argv(job_id, step_id, signal), timeout_s=timeout_s, env=env)


EXIT_NOT_EXCLUDED = 99  # render.requeue_excluding_argv: requeued, the exclusion refused


def requeue(job_id: str, exclude: Sequence[str] = (), *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str | None:
    """Requeue the job (it restarts with SLURM_RESTART_COUNT + 1) and keep it off the nodes in
    ``exclude`` (its ExcNodeList, set as it turns pending again). Returns None, or a warning
    when the job was requeued but Slurm refused the exclusion; raises when it was not requeued.
    """
    try:
        run(render.requeue_excluding_argv(job_id, exclude), timeout_s=timeout_s, env=env)
    except SlurmCommandError as e:
        if e.returncode != EXIT_NOT_EXCLUDED:
            raise
        return (
            f"job {job_id} requeued, but its ExcNodeList could not be set to {sorted(exclude)} ({e.stderr or e}); "
            "the restarted job still never uses those nodes, it may only be given them"
        )
    return None


def job_states(job_ids: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """job id -> state for every job squeue still lists, in one call ({} when it knows none)."""
    if not job_ids:
        return {}
    try:
        done = run(render.squeue_states_argv(job_ids), timeout_s=timeout_s, env=env)
    except SlurmCommandError as e:
        if "Invalid job id" in e.stderr:
            return {}
        raise
    return render.parse_squeue_states(done.stdout)


WAITING = ("PENDING", "CONFIGURING")  # a job that has not started yet (a companion job may still give nodes)


def submit_companion(argv: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """Submit a job rendered by ``render.companion_sbatch_argv``; its id."""
    out = run(argv, timeout_s=timeout_s, env=env).stdout.strip()
    job_id = out.split(";")[0].strip()  # --parsable: "ID" or "ID;CLUSTER"
    if not job_id.isdigit():
        raise SlurmCommandError(list(argv), f"sbatch printed {out!r}, not a job id")
    return job_id


def cancel_job(job_id: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
    run(render.scancel_argv(job_id), timeout_s=timeout_s, env=env)


def job_state(job_id: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str | None:
    """PENDING, RUNNING, COMPLETING, COMPLETED, ...; None when Slurm no longer knows it.

    squeue first; `scontrol show job` for jobs squeue does not list (no sacct on the
    test cluster: finished jobs stay in slurmctld for MinJobAge).
    """
    try:
        state = run(render.squeue_state_argv(job_id), timeout_s=timeout_s, env=env).stdout.strip()
    except SlurmCommandError as error:
        if _INVALID_JOB not in error.stderr:
            raise
        state = ""
    if state:
        return state.split()[0]
    return _scontrol_job_state(job_id, timeout_s=timeout_s, env=env)


def _scontrol_job_state(job_id: str, *, timeout_s: float, env: Mapping[str, str] | None) -> str | None:
    try:
        done = run(render.scontrol_show_job_argv(job_id), timeout_s=timeout_s, env=env)
    except SlurmCommandError as error:
        if _INVALID_JOB in error.stderr:
            return None
        raise
    return parse_job_field(done.stdout, "JobState")


def parse_job_field(show_job: str, field: str) -> str | None:
    """A ``Key=Value`` field of `scontrol --oneliner show job` output; None if absent."""
    prefix = field + "="
    for token in show_job.split():
        if token.startswith(prefix):
            return token[len(prefix) :]
    return None


def update_pending_job(
    job_id: str,
    exclude: Sequence[str] = (),
    num_nodes: int | None = None,
    start_in_s: int | None = 2,
    *,
    wait_pending_s: float = 30.0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> None:
    """Wait until the job is PENDING (e.g. after a requeue), then update it.

    Waiting matters: while the job is still COMPLETING, a StartTime set on it is silently
    overwritten.
    """
    argv = render.scontrol_update_job_argv(job_id, exclude=exclude, num_nodes=num_nodes, start_in_s=start_in_s)
    wait_for_state(job_id, "PENDING", within_s=wait_pending_s, timeout_s=timeout_s, env=env)
    run(argv, timeout_s=timeout_s, env=env)


def wait_for_state(job_id: str, wanted: str, *, within_s: float, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
    """Poll `job_state` (backing off 0.1 s -> 1 s) until it is WANTED."""
    deadline = time.monotonic() + within_s
    pause_s, state = 0.1, None
    while True:
        state = job_state(job_id, timeout_s=timeout_s, env=env)
        if state == wanted:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} is {state}, not {wanted}, after {within_s} s. HINT: check `scontrol show job` for its Reason")
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 1.0)


def slurm_available(*, timeout_s: float = 5.0, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(True, reason) when the client tools exist and slurmctld answers `scontrol ping`."""
    path = (env or {}).get("PATH", os.environ.get("PATH"))
    for tool in ("sinfo", "scontrol"):
        if shutil.which(tool, path=path) is None:
            return False, f"{tool} not found on PATH. HINT: install slurm-client or use cluster=local"
    try:
        out = run(["scontrol", "ping"], timeout_s=timeout_s, env=env).stdout.strip()
    except SlurmCommandError as error:
        return False, str(error)
    if " is UP" not in out:
        return False, f"slurmctld is not up: {out!r}. HINT: check SLURM_CONF and slurmctld's log"
    return True, out
