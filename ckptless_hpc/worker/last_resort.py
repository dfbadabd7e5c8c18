"""The last resort of a headless Slurm job: its coordinator (the batch host) is gone.

The first rank to claim the lock saves its committed state once, records it for the restart,
and requeues the job; every worker then exits. A closed control connection alone does not mean
the coordinator is gone: it also drops a worker it has declared failed (a node whose slurmd
died: Slurm ends the step's srun while the tasks live on). So a worker first asks the
coordinator's address (``coordinator_alive``); one dropped by a live coordinator exits without
a copy and without a requeue, and the job goes on with a spare in its place. A hot spare claims the lock only when no rank
has within ``spare_wait_s`` (every rank died with the coordinator): it requeues from the last
copy there is, or from step 0. Past ``cluster.max_requeues`` the job is cancelled instead.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, Optional, Sequence, Set

from ..rundir import restart as restart_file
from ..rundir.paths import RESTART, RunPaths
from ..rundir.record import RecordError

log = logging.getLogger("ckptless_hpc.worker")

PROBE_TIMEOUT_S = 5.0


def coordinator_alive(address: str, secret: str, worker: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the job's own coordinator still answers at ``address`` (HOST:PORT): it must pass
    the mutual handshake (it proves it knows the job secret, so a stranger on a reused port
    does not count). The probe then says why it came and leaves; the coordinator logs it as a
    rejected connection naming this worker. A refused, timed-out or failed handshake: gone."""
    from ..control import wire
    from ..control.messages import Probe

    host, _, port = address.rpartition(":")
    try:
        sock = wire.connect(host, int(port), secret, timeout_s=timeout_s)
    except (OSError, ValueError, wire.ProtocolError):
        return False
    try:
        wire.send_msg(sock, Probe(worker, "dropped: checking whether the coordinator is alive before any last resort").encode())
    except OSError:
        pass
    finally:
        sock.close()
    return True


def run(
    run_dir: str,
    node: str,
    rank: Optional[int],
    step: Optional[int],
    faults_done: Set[int],
    max_requeues: int,
    save: Callable[[str], Dict[str, Any]],
    spare_wait_s: float,
    site_exclude: Sequence[str] = (),
) -> None:
    from ..slurm.env import SlurmEnvironment

    env, paths = SlurmEnvironment(), RunPaths(run_dir)
    state_dir = paths.state
    lock = paths.last_resort_lock(env.restart_count)
    spare = rank is None or step is None
    if spare:
        deadline = time.monotonic() + spare_wait_s
        while time.monotonic() < deadline and not os.path.exists(lock):
            time.sleep(0.2)
    try:
        os.makedirs(state_dir, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, f"{node} {os.getpid()} {'spare' if spare else f'rank {rank}'}\n".encode())
        os.close(fd)
    except FileExistsError:
        log.info("another worker writes the last-resort copy and requeues")
        return
    except OSError as e:
        log.error(
            "cannot claim %s (%s): nothing can be saved in %s; the job is left to Slurm (its time limit). "
            "HINT: the run dir must be writable from every node (hydra.run.dir on a shared, writable filesystem)",
            lock,
            e.strerror,
            state_dir,
        )
        return
    restart = restart_file.read_or_empty(run_dir)
    if spare:
        saved = restart.get("saved")
        log.error("no rank survived the coordinator: requeueing; the job restarts from %s", f"the copy of step {saved['step']}" if saved else "step 0 (no copy was ever written)")
        restart = restart_file.after_last_resort(restart)
    else:
        saved = _save_or_keep(save, paths.emergency, restart.get("saved"))
        restart = restart_file.after_last_resort(restart, saved, faults_done)
    try:
        restart_file.write(run_dir, restart)
    except RecordError as e:
        log.error("%s; the restarted job resumes from what %s said before", e, RESTART)
    requeue_or_cancel(env, saved, max_requeues, run_dir, sorted(set(restart["excluded_nodes"]) | set(site_exclude)))


def _save_or_keep(save: Callable[[str], Dict[str, Any]], path: str, previous: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """This rank's copy (or the newer one already there); if it cannot be written (a full disk,
    a read-only run dir), the previous copy, untouched, is what the restart resumes from."""
    from ..state.emergency import EmergencyCopyError

    try:
        return save(path)
    except EmergencyCopyError as e:
        log.error("%s The restart resumes from %s", e, f"the previous copy of step {previous['step']}" if previous else "step 0 (no copy was ever written)")
        return previous


def requeue_or_cancel(env: Any, saved: Optional[Dict[str, Any]], max_requeues: int, run_dir: str, exclude: Sequence[str] = ()) -> None:
    """Requeue the headless job, never again onto the ``exclude`` nodes; past ``max_requeues``
    cancel it instead, so that it does not hold its allocation with nobody left to train (the
    copy stays in the run dir)."""
    from ..slurm import commands

    job_id = env.require_job_id()
    try:
        state = commands.job_state(job_id)
    except commands.SlurmCommandError as e:  # cannot tell: act as if it still runs
        log.warning("could not read the state of job %s (%s); assuming RUNNING", job_id, e)
        state = "RUNNING"
    try:
        if state != "RUNNING":  # cancelled, timed out or requeued already: Slurm is ending this run
            log.warning("job %s is %s: Slurm is already ending this run; not requeueing", job_id, state)
        elif env.restart_count >= max_requeues:
            log.error(
                "not requeueing: already requeued %d time(s) (cluster.max_requeues=%d); cancelling job %s. "
                "HINT: the last copy stays in %s/state; raise cluster.max_requeues to allow more restarts",
                env.restart_count,
                max_requeues,
                job_id,
                run_dir,
            )
            commands.cancel_job(job_id)
        else:
            warning = commands.requeue(job_id, exclude=exclude)
            log.warning("job %s requeued, excluding %s; it resumes from step %d", job_id, list(exclude) or "no node", saved["step"] if saved else 0)
            if warning:
                log.warning("%s", warning)
    except commands.SlurmCommandError as e:
        log.error("requeue/cancel of job %s failed: %s. HINT: requeue it by hand (scontrol requeue %s) or scancel it", job_id, e, job_id)
