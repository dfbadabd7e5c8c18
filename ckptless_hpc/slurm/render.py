"""Render the job shape into sbatch parameters, #SBATCH lines and srun/scontrol argv.

Pure: no subprocess. The shape is written once (`SlurmShape`); everything else is
rendered from it. Facts behind the flags: DESIGN.md "Slurm mapping" and
tests/slurm_cluster/README.md.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckptless_hpc.slurm.env import compress_nodelist

# Coordinator's preemption/time-limit signal. "B:" sends it to the batch shell only; with
# the script ending in `exec python ...` that shell *is* the coordinator.
COORDINATOR_SIGNAL = "USR2"

_JOB_ID_RE = re.compile(r"^\d+(?:[_+]\d+)?$")
_NODE_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_OPTION_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
_SIGNAL_RE = re.compile(r"^(?:SIG)?[A-Z][A-Z0-9]*$|^\d+$")

# sbatch options the shape owns; `additional` may not set them (normalized to "_").
_OWNED_OPTIONS = {
    "job_name": "job_name",
    "nodes": "nodes + spare_nodes",
    "ntasks_per_node": "tasks_per_node",
    "ntasks": "nodes and tasks_per_node",
    "gpus_per_node": "gpus_per_node",
    "cpus_per_task": "cpus_per_task",
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "constraint": "constraint",
    "time": "time_min",
    "mem": "mem_gb",
    "exclude": "exclude",
    "signal": "signal_delay_s",
    "no_kill": "(always on)",
    "requeue": "(always on)",
    "output": "output_dir",
    "error": "output_dir",
    "open_mode": "(always append)",
}


@dataclass(frozen=True)
class SlurmShape:
    """The shape of one fault-tolerant job, written once.

    The allocation holds ``nodes + spare_nodes`` nodes; the coordinator runs in the
    batch step and starts one srun step per node.
    """

    job_name: str = "ckptless"
    nodes: int = 1  # worker nodes
    spare_nodes: int = 0  # hot-spare nodes in the same allocation
    tasks_per_node: int = 1  # worker ranks per node
    gpus_per_node: int = 0  # 0 = none
    cpus_per_task: int = 0  # 0 = unset (Slurm default)
    partition: str = ""  # "" = cluster default
    account: str = ""
    qos: str = ""
    constraint: str = ""
    time_min: int = 60
    mem_gb: int = 0  # 0 = unset
    exclude: Sequence[str] = ()  # node names never to run on; stored as a tuple
    signal_delay_s: int = 120  # USR2 this long before the time limit
    additional: Mapping[str, str | bool] = field(default_factory=dict)  # extra sbatch options; True = flag
    setup: Sequence[str] = ()  # shell lines run before the coordinator; stored as a tuple
    output_dir: str = ""  # "" = Slurm's default (slurm-%j.out in the submit dir)

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "setup", tuple(self.setup))
        object.__setattr__(self, "additional", dict(self.additional))  # a copy: callers keep theirs
        _validate_shape(self)

    @property
    def total_nodes(self) -> int:
        """Nodes in the allocation: workers plus spares."""
        return self.nodes + self.spare_nodes


def _validate_shape(shape: SlurmShape) -> None:
    if not shape.job_name.strip() or "\n" in shape.job_name:
        raise _field_error("job_name", shape.job_name, "use a short one-line name such as 'ckptless'")
    _check_int("nodes", shape.nodes, minimum=1)
    _check_int("spare_nodes", shape.spare_nodes, minimum=0)
    _check_int("tasks_per_node", shape.tasks_per_node, minimum=1)
    _check_int("gpus_per_node", shape.gpus_per_node, minimum=0)
    _check_int("cpus_per_task", shape.cpus_per_task, minimum=0)
    _check_int("time_min", shape.time_min, minimum=1)
    _check_int("mem_gb", shape.mem_gb, minimum=0)
    _check_int("signal_delay_s", shape.signal_delay_s, minimum=0)
    if shape.signal_delay_s >= shape.time_min * 60:
        raise _field_error(
            "signal_delay_s",
            shape.signal_delay_s,
            f"it must be shorter than time_min ({shape.time_min} min = {shape.time_min * 60} s)",
        )
    for name in ("partition", "account", "qos", "constraint"):
        _check_one_line(name, getattr(shape, name))
    for node in shape.exclude:
        _check_node(node, "exclude")
    for line in shape.setup:
        _check_one_line("setup", line)
    _check_one_line("output_dir", shape.output_dir)
    if "%" in shape.output_dir:
        raise _field_error(
            "output_dir",
            shape.output_dir,
            "Slurm expands '%' in output paths (%j, %N, ...): choose a directory without '%'",
        )
    _check_additional(shape.additional)


def _check_additional(additional: Mapping[str, str | bool]) -> None:
    for key, value in additional.items():
        if not isinstance(key, str) or not _OPTION_RE.match(key):
            raise _field_error("additional", key, "keys are sbatch long options without '--', e.g. 'mail-type'")
        owner = _OWNED_OPTIONS.get(key.replace("-", "_"))
        if owner is not None:
            raise _field_error(f"additional[{key!r}]", value, f"the shape owns this option: set SlurmShape.{owner}")
        if value is not True and not isinstance(value, str):
            raise _field_error(f"additional[{key!r}]", value, "values are strings, or True for a bare flag")
        if isinstance(value, str):
            _check_one_line(f"additional[{key!r}]", value)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field_error(name, value, f"use an integer >= {minimum}")


def _check_one_line(name: str, value: object) -> None:
    if not isinstance(value, str) or "\n" in value or "\r" in value:
        raise _field_error(name, value, "use a single-line string")


def _check_node(node: object, name: str) -> None:
    if not isinstance(node, str) or not _NODE_RE.match(node):
        raise _field_error(name, node, "give single node names such as 'n3', not node lists like 'n[1-3]'")


def _field_error(name: str, value: object, hint: str) -> ValueError:
    return ValueError(f"invalid Slurm setting {name}={value!r}. HINT: {hint}.")


# ---- sbatch -----------------------------------------------------------------------------


def sbatch_parameters(shape: SlurmShape) -> dict[str, str | int | bool]:
    """The coordinator job's shape for submitit's ``slurm_additional_parameters``.

    Keys use submitit's own names (``_``; it renders them as ``--key-with-dashes``), so
    they replace the generic ``nodes=1``/``ntasks_per_node=1``/``signal`` submitit puts
    in the script instead of adding a second flag. ``True`` renders as a bare flag.
    Output paths are left to submitit's folder. Submit with ``slurm_use_srun=False``
    and ``slurm_python="exec " + sys.executable``.
    """
    params: dict[str, str | int | bool] = {
        "job_name": shape.job_name,
        "nodes": shape.total_nodes,
        "ntasks_per_node": shape.tasks_per_node,
        "time": shape.time_min,
        "no_kill": True,
        "requeue": True,
        "signal": f"B:{COORDINATOR_SIGNAL}@{shape.signal_delay_s}",
    }
    optional: dict[str, str | int] = {
        "gpus_per_node": shape.gpus_per_node,
        "cpus_per_task": shape.cpus_per_task,
        "mem": f"{shape.mem_gb}GB" if shape.mem_gb else "",
        "partition": shape.partition,
        "account": shape.account,
        "qos": shape.qos,
        "constraint": shape.constraint,
        "exclude": compress_nodelist(shape.exclude),
    }
    params.update({key: value for key, value in optional.items() if value})
    params.update(shape.additional)
    return params


def companion_sbatch_argv(shape: SlurmShape, main_job_id: str, nodes: int, exclude: Sequence[str] = (), output: str | None = None) -> list[str]:
    """``cluster.grow=job``: ``sbatch --parsable`` of a companion job of ``nodes`` replacement
    nodes for job ``main_job_id``, of the job's own shape per node (partition, account, qos,
    constraint, GPUs, CPUs, memory, time limit, extra options), never on ``exclude``. Its batch
    script only holds the nodes: the job's coordinator starts worker steps in it (``srun
    --jobid``), and it ends by itself once the main job is no longer RUNNING (requeued, ended)."""
    main = _check_job_id(main_job_id)
    _check_int("nodes", nodes, minimum=1)
    params: dict[str, str | int | bool] = dict(sbatch_parameters(shape))
    for key in ("requeue", "signal"):  # it never requeues: the main job's coordinator owns the run
        params.pop(key, None)
    params.update(job_name=f"{shape.job_name}-grow-{main}", nodes=nodes, ntasks_per_node=1, parsable=True)
    params.pop("exclude", None)
    if exclude or shape.exclude:
        params["exclude"] = compress_nodelist(sorted(set(exclude) | set(shape.exclude)))
    if output:
        params["output"] = _check_log_path(output)
    hold = f'while [ "$(squeue --noheader --jobs={main} --format=%T)" = RUNNING ]; do sleep 10; done'
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in params.items()]  # an argv: no shell quoting
    return ["sbatch", *flags, f"--wrap={hold}"]


def sbatch_header(shape: SlurmShape) -> list[str]:
    """``#SBATCH`` lines for the same shape (dry-run, templates), values shell-quoted.

    sbatch's parser honours shell quoting in #SBATCH lines (checked on 22.05 with
    spaces, ``;`` and both kinds of quotes in paths).
    """
    params: dict[str, str | int | bool] = dict(sbatch_parameters(shape))
    if shape.output_dir:
        params["output"] = shape.output_dir.rstrip("/") + "/coordinator-%j.out"
        params["open_mode"] = "append"  # a requeued run appends to the same log
    return [_sbatch_flag(key, value) for key, value in params.items()]


def sbatch_script(shape: SlurmShape, command: Sequence[str]) -> str:
    """A whole batch script: header, setup lines, then ``exec COMMAND``.

    ``exec`` makes the coordinator the batch shell, so ``--signal=B:USR2`` reaches it.
    Setup lines are shell code and go in verbatim.
    """
    if not command:
        raise _field_error("command", list(command), "give the coordinator command, e.g. ['python', '-m', 'ckptless_hpc']")
    lines = ["#!/bin/bash", *sbatch_header(shape), ""]
    if shape.setup:
        lines += ["# setup", *shape.setup, ""]
    lines += ["exec " + shlex.join(command), ""]
    return "\n".join(lines)


def _sbatch_flag(key: str, value: str | int | bool) -> str:
    option = key.replace("_", "-")
    if value is True:
        return f"#SBATCH --{option}"
    return f"#SBATCH --{option}={shlex.quote(str(value))}"


# ---- srun -------------------------------------------------------------------------------


def srun_worker_argv(
    node: str,
    ntasks: int,
    command: Sequence[str],
    *,
    job_id: str | None,
    log_path: str | None,
    gpus_per_node: int = 0,
    cpus_per_task: int = 0,
    immediate_s: int = 10,
    extra: Sequence[str] = (),
) -> list[str]:
    """One worker step on one node: ``srun --nodes=1 --ntasks=N ... -- COMMAND``.

    Always explicit --ntasks (srun otherwise inherits the batch's SLURM_NTASKS),
    --nodelist and --immediate (a step asking for nodes the job no longer has would
    wait forever). --kill-on-bad-exit=0: one task's exit does not kill its siblings.
    No --overlap: each step has its own node (pass it in ``extra`` to share one).
    """
    _check_node(node, "node")
    _check_int("ntasks", ntasks, minimum=1)
    _check_int("gpus_per_node", gpus_per_node, minimum=0)
    _check_int("cpus_per_task", cpus_per_task, minimum=0)
    _check_int("immediate_s", immediate_s, minimum=1)
    if not command:
        raise _field_error("command", list(command), "give the worker command, e.g. ['python', '-m', 'ckptless_hpc.worker']")
    argv = ["srun", "--nodes=1", f"--ntasks={ntasks}", f"--ntasks-per-node={ntasks}", f"--nodelist={node}"]
    argv += [f"--immediate={immediate_s}", "--kill-on-bad-exit=0"]
    if job_id is not None:
        argv.append(f"--jobid={_check_job_id(job_id)}")
    if log_path is not None:
        argv.append(f"--output={_check_log_path(log_path)}")  # stderr goes there too
    if gpus_per_node:
        argv.append(f"--gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        argv.append(f"--cpus-per-task={cpus_per_task}")
    return [*argv, *extra, "--", *command]


def _check_log_path(path: str) -> str:
    _check_one_line("log_path", path)
    if not path:
        raise _field_error("log_path", path, "give a file path, or None to inherit srun's stdout")
    return path


def _check_job_id(job_id: object) -> str:
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id):
        raise _field_error("job_id", job_id, "use Slurm's numeric job id as a string, e.g. '1234'")
    return job_id


# ---- scontrol / squeue / scancel --------------------------------------------------------


def scontrol_down_argv(node: str, reason: str) -> list[str]:
    """Set a node DOWN now: its steps end at once and it leaves running jobs."""
    _check_node(node, "node")
    _check_one_line("reason", reason)
    if not reason.strip():
        raise _field_error("reason", reason, "Slurm requires a reason to down a node, e.g. 'ckptless: heartbeat lost'")
    return ["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"]


def scontrol_drain_argv(node: str, reason: str) -> list[str]:
    """Drain a node: no new job is placed on it (it survives slurmd restarts, unlike DOWN)."""
    return [*scontrol_down_argv(node, reason)[:3], "state=drain", f"reason={reason}"]


def scancel_step_argv(job_id: str, step_id: int, signal: str = "KILL") -> list[str]:
    """Signal every task of one step (all nodes of the step)."""
    if not isinstance(step_id, int) or step_id < 0:
        raise _field_error("step_id", step_id, "a step id is a non-negative integer, e.g. 3")
    if not _SIGNAL_RE.match(signal):
        raise _field_error("signal", signal, "use a signal name such as 'KILL'")
    return ["scancel", f"--signal={signal}", f"{_check_job_id(job_id)}.{step_id}"]


def scontrol_requeue_argv(job_id: str) -> list[str]:
    """Requeue a job (the last resort; the batch restarts with SLURM_RESTART_COUNT+1)."""
    return ["scontrol", "requeue", _check_job_id(job_id)]


def requeue_excluding_argv(job_id: str, exclude: Sequence[str] = ()) -> list[str]:
    """Requeue the job, then at once exclude ``exclude`` from its next allocation.

    A running job's ExcNodeList cannot be changed ("Job is no longer pending execution"), but
    from the moment ``scontrol requeue`` returns the job is pending again (shown COMPLETING
    while its processes end) and the update is taken: Slurm 22.05, tests/slurm. Both commands
    run in one ``sh`` that ignores SIGTERM (so do its children), because the requeue itself
    sends SIGTERM to the caller's processes: the update is never cut off between the two.
    Exit 99: requeued, but the exclusion was refused.
    """
    job = _check_job_id(job_id)
    if not exclude:
        return scontrol_requeue_argv(job)
    update = scontrol_update_job_argv(job, exclude=exclude, start_in_s=None)
    script = 'trap "" TERM; scontrol requeue "$1" || exit $?; shift; "$@" || exit 99'
    return ["sh", "-c", script, "sh", job, *update]


def scontrol_update_job_argv(
    job_id: str,
    exclude: Sequence[str] = (),
    num_nodes: int | None = None,
    start_in_s: int | None = 2,
) -> list[str]:
    """Update a PENDING job (e.g. after a requeue): excluded nodes, node count, start time.

    ``start_in_s`` >= 2: a job started in the same second as its requeue is killed with
    "Job credential revoked" and ends FAILED, not requeued.
    """
    argv = ["scontrol", "update", f"jobid={_check_job_id(job_id)}"]
    for node in exclude:
        _check_node(node, "exclude")
    if exclude:
        argv.append(f"ExcNodeList={compress_nodelist(exclude)}")
    if num_nodes is not None:
        _check_int("num_nodes", num_nodes, minimum=1)
        argv.append(f"NumNodes={num_nodes}")
    if start_in_s is not None:
        _check_int("start_in_s", start_in_s, minimum=2)
        argv.append(f"StartTime=now+{start_in_s}")
    if len(argv) == 3:
        raise _field_error("update", "nothing", "give exclude, num_nodes or start_in_s")
    return argv


def squeue_nodes_argv(job_id: str) -> list[str]:
    """The job's current node list, one compressed line (``%N``); "" while pending."""
    return ["squeue", "--noheader", f"--jobs={_check_job_id(job_id)}", "--format=%N"]


def sinfo_states_argv(nodes: Sequence[str]) -> list[str]:
    """Each of NODES with its state, one per line (``%N %T``: name and long state, e.g. draining)."""
    return ["sinfo", "--noheader", "--Node", f"--nodes={','.join(nodes)}", "--format=%N %T"]


def squeue_states_argv(job_ids: Sequence[str]) -> list[str]:
    """The states of many jobs in one squeue call (``%i %T``: job id and state)."""
    return ["squeue", "--noheader", f"--jobs={','.join(_check_job_id(j) for j in job_ids)}", "--format=%i %T"]


def parse_squeue_states(out: str) -> dict[str, str]:
    """``squeue_states_argv`` output -> job id (array suffix dropped) -> state."""
    states = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            states[parts[0].split("_")[0]] = parts[1]
    return states


def scancel_argv(job_id: str) -> list[str]:
    """Cancel a whole job."""
    return ["scancel", _check_job_id(job_id)]


def squeue_state_argv(job_id: str) -> list[str]:
    """The job's state (``%T``: PENDING, RUNNING, COMPLETING, ...)."""
    return ["squeue", "--noheader", f"--jobs={_check_job_id(job_id)}", "--format=%T"]


def scontrol_show_job_argv(job_id: str) -> list[str]:
    """The job record on one line (kept MinJobAge after it ends; no sacct needed)."""
    return ["scontrol", "--oneliner", "show", "job", _check_job_id(job_id)]


def scancel_signal_argv(job_id: str, signal: str, batch_only: bool = True) -> list[str]:
    """Send ``signal`` to the batch step only (``--batch``), or to it and all steps (``--full``)."""
    if not isinstance(signal, str) or not _SIGNAL_RE.match(signal):
        raise _field_error("signal", signal, "use a signal name such as 'USR2' or 'SIGTERM', or a number")
    scope = "--batch" if batch_only else "--full"
    return ["scancel", f"--signal={signal}", scope, _check_job_id(job_id)]
