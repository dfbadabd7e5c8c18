"""Every file and folder a job leaves in its run directory, named in one place (as submitit's
``JobPaths`` names every file of a job).

A run directory (``hydra.run.dir``) holds, over a job's life::

    events.jsonl          the event log, from the moment the coordinator starts (all attempts)
    summary.json          written once, when the job ends (or is requeued)
    restart.json          what a requeued Slurm job needs of the allocation before it
    job.json              cluster=slurm: written by ``submit`` (the job id), before the job runs
    coordinator.log       the coordinator's log
    logs/                 <worker>.log, relay-<node>.log, zygote.log (local);
                          <node>.<task>.log, srun-<node>.log (Slurm)
    .hydra/               Hydra's config.yaml, overrides.yaml (hydra.yaml)
    submitit/             cluster=slurm: submitit's own files (the batch script, its .out/.err)
    state/                emergency copies: emergency.pt and dcp/, emergency-step<S>/shard<i>.pt
                          and emergency-step<S>/dcp/, last-resort-<restart>.lock
    saved/step<S>/        train.save_every: state.pt or shard<i>.pt, and index.json once complete;
                          dcp/ (the copy as a DCP checkpoint) once written
    final/                train.save_final: model.pt, dcp/, and state/ (state.pt or shard<i>.pt, index.json)
    tensorboard/          train.tensorboard=true
    report.png            ``ckptless-hpc report``'s chart (default place)

The job secret never touches the run directory: launchers pass it in the environment.

Names are module constants (what a scan of the package checks nobody else spells, see
tests/unit/test_rundir_names.py); :class:`RunPaths` joins them onto one run directory. Pure:
nothing here touches the filesystem except :meth:`RunPaths.is_run_dir`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple

# ------------------------------------------------------------------------------ file names
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
RESTART = "restart.json"
JOB = "job.json"
COORDINATOR_LOG = "coordinator.log"
INDEX = "index.json"  # a state folder's index (saved/step<S>/, final/state/)
MODEL = "model.pt"  # the full model (final/model.pt; the default of ``ckptless-hpc export --out``)
DCP = "dcp"  # a saved state as a torch.distributed.checkpoint checkpoint (final/dcp/, <copy>/dcp/: copy_dcp; state/dcp.py)
DCP_SOURCE = "copy.json"  # in a DCP folder: the job's own copy it was written from (its files, step, state sha256s)
EMERGENCY = "emergency.pt"  # the replicated emergency copy (state/emergency.pt)
STATE_FILE = "state.pt"  # one whole replicated state in a state folder
REPORT = "report.png"
ZYGOTE_LOG = "zygote.log"
HYDRA_CONFIG = "config.yaml"
HYDRA_OVERRIDES = "overrides.yaml"

# ------------------------------------------------------------------------------ folder names
LOGS = "logs"
HYDRA = ".hydra"
SUBMITIT = "submitit"
STATE = "state"
SAVED = "saved"
FINAL = "final"
TENSORBOARD = "tensorboard"
REQUESTS = "requests"  # what a user asks of a running job (``ckptless-hpc drain``): one file per request (rundir/requests.py)

#: Files that make a directory a run directory: events (the coordinator started), the summary
#: (it ended), job.json (a Slurm job was submitted and may still be pending).
RUN_MARKERS = (EVENTS, SUMMARY, JOB)

#: A sharded state's file in a state folder: shard<i>.pt.
SHARD_FILE = re.compile(r"^shard(\d+)\.pt$")
#: A periodic copy's folder in saved/: step<S>.
STEP_FOLDER = re.compile(r"step(\d+)")


def state_file(shard: Optional[int]) -> str:
    """The name of a state file in a state folder: ``state.pt`` (replicated, ``shard`` None) or ``shard<i>.pt``."""
    return STATE_FILE if shard is None else f"shard{shard}.pt"


def step_folder(step: int) -> str:
    """The name of a periodic copy's folder in saved/: ``step<S>``."""
    return f"step{step}"


def copy_dcp(folder: str) -> str:
    """The DCP folder of the saved copy whose state files lie in ``folder``: ``dcp/`` beside them
    (saved/step<S>/dcp, state/dcp, state/emergency-step<S>/dcp); the final state's is final/dcp
    (beside final/state/)."""
    folder = os.path.normpath(folder)
    if os.path.basename(folder) == STATE and os.path.basename(os.path.dirname(folder)) == FINAL:
        folder = os.path.dirname(folder)
    return os.path.join(folder, DCP)


def step_of_folder(name: str) -> Optional[int]:
    """The step of a saved/ folder name (``step12`` -> 12); None for any other name."""
    m = STEP_FOLDER.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunPaths:
    """The paths of one run directory. Strings (``os.path.join`` onto ``root`` as given), so that
    every path a message, a log line or summary.json carries stays what it is today."""

    root: str

    def _join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # --- the record of the job
    @property
    def events(self) -> str:
        return self._join(EVENTS)

    @property
    def summary(self) -> str:
        return self._join(SUMMARY)

    @property
    def restart(self) -> str:
        return self._join(RESTART)

    @property
    def job(self) -> str:
        """cluster=slurm: ``{"job_id": ...}``, written by ``submit``."""
        return self._join(JOB)

    @property
    def markers(self) -> Tuple[str, ...]:
        """The files whose presence makes ``root`` a run directory (:data:`RUN_MARKERS`)."""
        return tuple(self._join(n) for n in RUN_MARKERS)

    def is_run_dir(self) -> bool:
        return any(os.path.exists(p) for p in self.markers)

    @property
    def requests(self) -> str:
        """requests/: ``ckptless-hpc drain``'s requests, taken by the coordinator (rundir/requests.py)."""
        return self._join(REQUESTS)

    # --- logs
    @property
    def coordinator_log(self) -> str:
        return self._join(COORDINATOR_LOG)

    @property
    def logs(self) -> str:
        return self._join(LOGS)

    def worker_log(self, worker: str) -> str:
        """logs/<worker>.log (``worker`` is NODE.I)."""
        return self._join(LOGS, f"{worker}.log")

    def relay_log(self, node: str) -> str:
        return self._join(LOGS, f"relay-{node}.log")

    def srun_log(self, node: str) -> str:
        """cluster=slurm: the output of srun itself for a node's step."""
        return self._join(LOGS, f"srun-{node}.log")

    def node_task_log(self, node: str) -> str:
        """cluster=slurm: srun's ``--output`` pattern of a node's step (``%t``: the task)."""
        return self._join(LOGS, f"{node}.%t.log")

    @property
    def zygote_log(self) -> str:
        return self._join(LOGS, ZYGOTE_LOG)

    # --- Hydra and submitit
    @property
    def hydra(self) -> str:
        return self._join(HYDRA)

    @property
    def hydra_config(self) -> str:
        return self._join(HYDRA, HYDRA_CONFIG)

    @property
    def hydra_overrides(self) -> str:
        return self._join(HYDRA, HYDRA_OVERRIDES)

    @property
    def submitit(self) -> str:
        return self._join(SUBMITIT)

    # --- training state
    @property
    def state(self) -> str:
        """state/: the emergency copies (and the last resort's locks)."""
        return self._join(STATE)

    @property
    def emergency(self) -> str:
        """state/emergency.pt: the replicated emergency copy."""
        return self._join(STATE, EMERGENCY)

    def emergency_folder(self, step: int) -> str:
        """state/emergency-step<S>/: a sharded emergency copy (one shard<i>.pt per shard)."""
        return self._join(STATE, f"emergency-step{step}")

    def last_resort_lock(self, restart_count: int) -> str:
        """state/last-resort-<N>.lock: claimed by the one worker that saves and requeues a headless job."""
        return self._join(STATE, f"last-resort-{restart_count}.lock")

    @property
    def saved(self) -> str:
        """saved/: the periodic copies of train.save_every."""
        return self._join(SAVED)

    def saved_step(self, step: int) -> str:
        return self._join(SAVED, step_folder(step))

    def saved_index(self, step: int) -> str:
        return self._join(SAVED, step_folder(step), INDEX)

    @property
    def final(self) -> str:
        return self._join(FINAL)

    @property
    def final_model(self) -> str:
        return self._join(FINAL, MODEL)

    @property
    def final_dcp(self) -> str:
        """The whole final state as a DCP checkpoint (state/dcp.py): dcp.load restores it into the user's own model and optimizer."""
        return self._join(FINAL, DCP)

    @property
    def final_state(self) -> str:
        return self._join(FINAL, STATE)

    @property
    def final_index(self) -> str:
        return self._join(FINAL, STATE, INDEX)

    # --- outputs for people
    @property
    def tensorboard(self) -> str:
        return self._join(TENSORBOARD)

    @property
    def report(self) -> str:
        """The default place of ``ckptless-hpc report``'s chart."""
        return self._join(REPORT)
