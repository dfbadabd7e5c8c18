"""Slurm backend: submit the coordinator through submitit; inside the allocation, one srun step per node.

On the login node ``submit`` renders the job shape from the config (written once), submits a
``SlurmJob`` and returns. In the batch step, ``SlurmJob.__call__`` runs the coordinator with a
``SlurmLauncher``: one ``srun -N1 -w NODE`` step per worker node and per spare node, so one
node's loss ends only its step (``--no-kill`` keeps the allocation). Slurm's warning signal
before a time limit or preemption reaches submitit's handler, which calls
``SlurmJob.checkpoint``: the workers write one emergency copy, the job requeues, and the
restarted job resumes from it with the failed nodes excluded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

from ..coordinator.continuity import proc_identity
from ..control.wire import SECRET_ENV, new_secret
from ..slurm import commands, render
from ..slurm.env import SERVED_JOB_ENV, SERVED_RESTARTS_ENV, SlurmEnvironment
from ..config import start_nodes
from ..rundir import paths
from . import worker_argv
from .background import CommandQueue
from .base import ExitCallback

log = logging.getLogger("ckptless_hpc.slurm")

EXIT_NO_SLURM = 2


def shape_from_config(cfg: Any, run_dir: str) -> render.SlurmShape:
    c = cfg.cluster
    return render.SlurmShape(
        job_name=cfg.job_name,
        nodes=start_nodes(c),  # cluster.start_nodes: the rest of the layout's nodes come later (refills, cluster.grow)
        spare_nodes=c.spare_nodes,
        # every worker node's CPUs for its workers' step (srun --ntasks=workers_per_node; an
        # allocation of one task per node refuses that step); the batch script itself still runs
        # the coordinator alone (no srun around it)
        tasks_per_node=int(c.workers_per_node),
        gpus_per_node=c.gpus_per_node,
        cpus_per_task=c.cpus_per_task,
        partition=c.partition or "",
        account=c.account or "",
        qos=c.qos or "",
        constraint=c.constraint or "",
        time_min=c.time_min,
        mem_gb=c.mem_gb,
        exclude=list(c.exclude),
        signal_delay_s=c.signal_delay_s,
        additional={k: v for k, v in (c.additional_parameters or {}).items()},
        setup=list(c.setup),
        output_dir=run_dir,
    )


def node_step_argv(cfg: Any, node: str, workers: int, coordinator: str, job_id: Optional[str], log_path: str) -> List[str]:
    """The srun of one node's step: its workers, and with ``cluster.control=node`` one more
    task, the last, the node's relay (launch/node_task.py), sharing the step's CPUs with the
    workers (--overcommit) rather than asking for one of its own."""
    c = cfg.cluster
    if c.control == "node":
        command = worker_argv.node_task_command(coordinator, node, str(c.heartbeat_interval_s), c.bind_host)
        tasks, extra = workers + 1, ["--overcommit"]
    else:
        command = worker_argv.worker_command(worker_argv.worker_args(coordinator, node, worker_argv.SLURM_INDEX, c.bind_host))
        tasks, extra = workers, []
    return render.srun_worker_argv(node, tasks, command, job_id=job_id, log_path=log_path, gpus_per_node=c.gpus_per_node, cpus_per_task=c.cpus_per_task, extra=extra)


def submit(cfg: Any, run_dir: str) -> Dict[str, Any]:
    """Submit the job (or, with cluster.submit=false, run it in the current allocation)."""
    from omegaconf import OmegaConf

    if not cfg.cluster.submit:  # inside an allocation already (slurm/train.sbatch)
        code = SlurmJob(OmegaConf.to_container(cfg, resolve=True), run_dir).run_here(own_signals=True)
        if code:
            sys.exit(code)
        return {"run_dir": run_dir, "exit_code": code}
    ok, why = commands.slurm_available()
    if not ok:
        print(f"ckptless_hpc: cluster=slurm but no Slurm is reachable: {why}. HINT: run where sinfo/sbatch work, or use cluster=local", file=sys.stderr)
        sys.exit(EXIT_NO_SLURM)
    import submitit

    os.makedirs(run_dir, exist_ok=True)
    shape = shape_from_config(cfg, run_dir)
    executor = submitit.SlurmExecutor(folder=paths.RunPaths(run_dir).submitit, python="exec " + sys.executable)
    executor.update_parameters(use_srun=False, nodes=1, ntasks_per_node=1, setup=list(shape.setup), additional_parameters=render.sbatch_parameters(shape))
    job = executor.submit(SlurmJob(OmegaConf.to_container(cfg, resolve=True), run_dir))
    info = {"job_id": job.job_id, "run_dir": run_dir}
    with open(paths.RunPaths(run_dir).job, "w", encoding="utf-8") as f:
        json.dump(info, f)
    print(f"submitted Slurm job {job.job_id} ({shape.nodes} worker node(s) + {shape.spare_nodes} spare(s))")
    print(f"run dir:  {run_dir}")
    print(f"follow:   tail -f {paths.RunPaths(run_dir).coordinator_log}   |   squeue -j {job.job_id}")
    return info


class SlurmJob:
    """The submitted callable: the coordinator, run in the batch step of the allocation."""

    def __init__(self, config: Dict[str, Any], run_dir: str) -> None:
        self.config = config
        self.run_dir = run_dir
        self._coordinator: Any = None
        self._done = threading.Event()

    def __getstate__(self) -> Dict[str, Any]:
        return {"config": self.config, "run_dir": self.run_dir}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["config"], state["run_dir"])  # type: ignore[misc]

    def __call__(self) -> Dict[str, Any]:
        code = self.run_here()
        if code not in (0, 5):
            raise RuntimeError(f"ckptless_hpc job ended with exit code {code}; see {self.run_dir}/{paths.SUMMARY}")
        return {"exit_code": code, "run_dir": self.run_dir}

    def checkpoint(self) -> Any:
        """submitit calls this on the warning signal: save once, then let submitit requeue us."""
        import submitit

        coord = self._coordinator
        if coord is not None:
            log.warning("warning signal received: saving one emergency copy before the requeue")
            coord.launcher.requeue_by_submitit = True
            _requeue_through_submitit_excluding(coord.launcher)
            coord.request_save("Slurm warning signal (time limit or preemption)")
            self._done.wait(coord.cfg.cluster.recovery_timeout_s + 30)
        return submitit.helpers.DelayedSubmission(self)

    def run_here(self, own_signals: bool = False) -> int:
        """Run the coordinator in this allocation. ``own_signals``: not under submitit (the sbatch
        template), so handle the warning signal here: save once, then ``scontrol requeue``."""
        from omegaconf import OmegaConf

        from ..coordinator.shell import Coordinator
        from .run import human_summary, resume_record, setup_logging

        cfg = OmegaConf.create(self.config)
        env = SlurmEnvironment()
        job_id = env.require_job_id()
        os.makedirs(self.run_dir, exist_ok=True)
        context = setup_logging(self.run_dir, job_id)
        if own_signals:
            # the allocation is the shape: worker nodes from the config, the rest are spares
            allocated, nodes = len(commands.live_nodes(job_id)), start_nodes(cfg)
            if allocated != nodes + cfg.cluster.spare_nodes:
                log.info("allocation of %d node(s): %d worker node(s), %d spare(s)", allocated, nodes, max(allocated - nodes, 0))
                cfg.cluster.spare_nodes = max(allocated - nodes, 0)
        restart = _read_json(paths.RunPaths(self.run_dir).restart) if env.restart_count > 0 else {}
        secret = new_secret()
        launcher = SlurmLauncher(cfg, self.run_dir, job_id, env, secret)
        coord = context.coordinator = Coordinator.from_config(cfg, self.run_dir, launcher, secret, job_id)
        launcher.commands.report = coord.command_done  # every scancel/scontrol outcome becomes an event
        coord.record.resume = resume_record(cfg)  # resume_from (a requeue's own copy, below, is newer)
        if restart:
            coord.restore(restart)
            log.info("restart %d of job %s: resuming from %s, excluded nodes %s", env.restart_count, job_id, restart.get("saved"), restart.get("excluded_nodes"))
        self._coordinator = coord
        if own_signals:
            signal.signal(signal.SIGUSR2, lambda *_: coord.request_save("Slurm warning signal (time limit or preemption)"))
        box: Dict[str, int] = {}

        def body() -> None:
            try:
                box["code"] = asyncio.run(coord.run())
            finally:
                self._done.set()

        # the coordinator's loop runs in a thread so that the main thread stays free for
        # submitit's signal handler (which calls checkpoint() and waits for the save)
        t = threading.Thread(target=body, name="coordinator")
        t.start()
        while t.is_alive():
            t.join(0.5)
        if coord.summary:
            print(human_summary(coord.summary), flush=True)
        return box.get("code", 1)


def _requeue_through_submitit_excluding(launcher: "SlurmLauncher") -> None:
    """submitit requeues the job itself once ``checkpoint`` returns, through
    ``SlurmJobEnvironment._requeue`` (a plain ``scontrol requeue``): have it requeue with the
    excluded nodes set on the pending job as well (``commands.requeue``)."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    def requeue(env: Any, countdown: int) -> None:
        warning = commands.requeue(env.job_id, exclude=launcher.requeue_exclusions(), timeout_s=60)
        log.info("requeued job %s (%d remaining timeouts)%s", env.job_id, countdown, f"; {warning}" if warning else "")

    SlurmJobEnvironment._requeue = requeue  # type: ignore[method-assign]


def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


class SlurmLauncher:
    """Worker and spare nodes as srun steps inside the allocation (all Slurm I/O via ckptless_hpc.slurm).

    ``kill_worker`` and ``exclude_node`` never wait for slurmctld: their scancel/scontrol go to
    a ``CommandQueue`` (one thread, in order), held while the coordinator plans a recovery and
    released once the promotion is sent. ``initial_nodes``, ``free_node`` and ``requeue`` do
    answer with Slurm's reply: the coordinator calls them off its event loop. A ``base.Launcher``.
    """

    batch_node: Optional[str] = None  # set from the environment: the batch host
    node_is_one_step = True  # one srun step per node: ``kill_worker`` ends the node's step, every rank of it
    measures_identity = True  # srun's process on the batch host, and the node's step id

    def __init__(self, cfg: Any, run_dir: str, job_id: str, env: SlurmEnvironment, secret: str) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.job_id = job_id
        self.env = env
        self.secret = secret
        self.log_dir = paths.RunPaths(run_dir).logs
        os.makedirs(self.log_dir, exist_ok=True)
        self._procs: Dict[str, Any] = {}  # node -> srun process
        self._steps: Dict[str, int] = {}  # node -> step id (reported by its workers)
        self._launched: Dict[str, Tuple[int, ...]] = {}  # node -> (srun pid, start ticks[, first step id])
        self._used: set = set()
        self._excluded: set = set()
        self._job_of: Dict[str, str] = {}  # node -> the companion job holding it (cluster.grow=job); others are this job's
        self._companion: Optional[str] = None  # the companion job replacement nodes are taken from now
        self._companions: List[str] = []  # every companion job submitted: cancelled at shutdown
        self._waiters: List["asyncio.Task[None]"] = []
        self.requeue_by_submitit = False
        self.batch_node = env.nodename  # the coordinator's node (the batch host)
        self.requeues = env.restart_count
        self.commands = CommandQueue(name=f"slurm-commands-{job_id}")

    def hold_commands(self) -> None:
        """A recovery is being planned: queue scheduler commands, issue none (see ``CommandQueue``)."""
        self.commands.hold()

    def release_commands(self) -> None:
        """The promotion is sent: issue the queued commands, in order."""
        self.commands.release()

    def initial_nodes(self, excluded: Any = ()) -> Tuple[List[str], List[str]]:
        c = self.cfg.cluster
        self._excluded = set(excluded)
        live = commands.live_nodes(self.job_id)
        usable = [n for n in live if n not in self._excluded]
        nodes = start_nodes(c)
        if len(usable) < nodes:
            raise RuntimeError(
                f"the allocation holds {len(usable)} usable node(s) {usable} (excluded: {sorted(self._excluded)}), "
                f"but the job starts on {nodes} (cluster.nodes={c.nodes}, cluster.start_nodes={c.start_nodes}). HINT: allocate at least that many + cluster.spare_nodes nodes"
            )
        active, spare = usable[:nodes], usable[nodes : nodes + c.spare_nodes]
        self._used.update(active + spare)
        return active, spare

    def free_node(self) -> Optional[str]:
        """A node of the allocation that is neither used nor excluded (one squeue call)."""
        try:
            live = commands.live_nodes(self.job_id)
        except commands.SlurmCommandError as e:
            log.warning("cannot list the allocation's nodes: %s", e)
            return None
        for n in live:
            if n not in self._used and n not in self._excluded:
                self._used.add(n)
                return n
        return None

    def companion(self, wanted: int) -> Tuple[str, bool]:
        """``cluster.grow=job``, no free node left in the allocation: the companion job to take
        replacement nodes from; a new one of ``wanted`` nodes is submitted unless one is pending
        or has nodes left. (job id, submitted now)."""
        if self._companion is not None:
            return self._companion, False
        shape = shape_from_config(self.cfg, self.run_dir)
        never = sorted(set(self.requeue_exclusions()) | self._used)  # a replacement is another node than any this job used
        argv = render.companion_sbatch_argv(shape, self.job_id, wanted, never, os.path.join(self.log_dir, "grow-%j.out"))
        self._companion = commands.submit_companion(argv)
        self._companions.append(self._companion)
        log.info("submitted companion job %s for %d replacement node(s) of job %s (cluster.grow=job)", self._companion, wanted, self.job_id)
        return self._companion, True

    def companion_node(self) -> Tuple[Optional[str], str]:
        """A node of the companion job that is neither used nor excluded, once it runs: (node,
        its state); (None, state) while it is pending, or when it ended or gave every node it
        has (it is then done with: the next :meth:`companion` submits another)."""
        job = self._companion
        if job is None:
            return None, "NONE"
        state = commands.job_state(job) or "GONE"
        if state == "RUNNING":
            for n in commands.live_nodes(job):
                if n not in self._used and n not in self._excluded:
                    self._used.add(n)
                    self._job_of[n] = job
                    return n, state
            state = "USED"
        if state not in commands.WAITING:
            self._companion = None
        return None, state

    def log_path(self, worker: str) -> str:
        return os.path.join(self.log_dir, f"{worker}.log")

    async def start_node(self, name: str, workers: int, coordinator: str, on_exit: ExitCallback) -> List[str]:
        job = self._job_of.get(name, self.job_id)
        argv = node_step_argv(self.cfg, name, workers, coordinator, job, os.path.join(self.log_dir, f"{name}.%t.log"))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.cfg.train.threads))
        env[SECRET_ENV] = self.secret  # the step's environment, never its command line
        if job != self.job_id:  # a companion job's node: its workers save and requeue this job, never their own
            env.update({SERVED_JOB_ENV: self.job_id, SERVED_RESTARTS_ENV: str(self.requeues)})
        with open(os.path.join(self.log_dir, f"srun-{name}.log"), "ab") as out:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env)
        self._procs[name] = proc
        self._launched[name] = proc_identity(proc.pid) or ()
        self._waiters.append(asyncio.ensure_future(self._watch(name, workers, proc, on_exit)))
        return [f"{name}.{j}" for j in range(workers)]

    async def _watch(self, name: str, workers: int, proc: Any, on_exit: Any) -> None:
        rc = await proc.wait()  # srun exits 0 after "Node failure": the step's end is what counts
        for j in range(workers):
            on_exit(f"{name}.{j}", rc)

    def register(self, worker: str, hello: Dict[str, Any]) -> None:
        """Note the node's step id, from its first worker's hello (the target of a scancel)."""
        if hello.get("slurm_step") is not None:
            node = worker.rpartition(".")[0]
            self._steps[node] = int(hello["slurm_step"])
            if len(self._launched.get(node, ())) == 2:  # the step the node's srun started, once
                self._launched[node] += (self._steps[node],)

    def kill_worker(self, worker: str) -> None:
        """A node's workers share one step: ending the worker ends its node's step. The local
        srun gets SIGKILL at once (its shepherd cancels the step); the scancel is queued."""
        node = worker.rpartition(".")[0]
        step = self._steps.pop(node, None)
        proc = self._procs.get(node)
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        if step is not None:
            job = self._job_of.get(node, self.job_id)
            self.commands.submit("cancel_step", partial(commands.cancel_step, job, step), job=job, node=node, slurm_step=step, worker=worker)

    def exclude_node(self, node: str, why: str) -> None:
        """Never placed again by this job (now); drained through Slurm when configured (queued)."""
        self._excluded.add(node)
        if self.cfg.cluster.drain_failed_nodes:
            reason = f"ckptless_hpc job {self.job_id}: {why}"[:200]
            self.commands.submit("drain_node", partial(commands.drain_node, node, reason), job=self.job_id, node=node)

    def drained_nodes(self, nodes: List[str]) -> List[str]:
        """Those of ``nodes`` Slurm shows draining or drained (one sinfo call); [] when it cannot say."""
        try:
            return commands.drained_nodes(nodes)
        except commands.SlurmCommandError as e:
            log.warning("cannot read the nodes' states: %s", e)
            return []

    def launched_identity(self, worker: str) -> Optional[Tuple[int, ...]]:
        """(srun pid, start ticks, step id) of the step this launcher started for ``worker``'s node."""
        return self._launched.get(worker.rpartition(".")[0]) or None

    def live_identity(self, worker: str) -> Optional[Tuple[int, ...]]:
        """The same, now: srun's process from /proc on the batch host, the node's step id."""
        node = worker.rpartition(".")[0]
        proc = self._procs.get(node)
        now = proc_identity(proc.pid) if proc is not None and proc.returncode is None else None
        step = self._steps.get(node)
        return None if now is None else now + (() if step is None else (step,))

    def requeue(self, reason: str) -> Optional[str]:
        """Requeue the job (None) or say why not. After submitit's signal it requeues us itself."""
        self.commands.flush(2 * commands.DEFAULT_TIMEOUT_S)  # a queued drain of a failed node comes first
        if self.requeue_by_submitit:
            return None
        if self.requeues >= self.cfg.cluster.max_requeues:
            return f"the job was already requeued {self.requeues} time(s) (cluster.max_requeues={self.cfg.cluster.max_requeues})"
        try:
            warning = commands.requeue(self.job_id, exclude=self.requeue_exclusions())
        except commands.SlurmCommandError as e:
            return f"scontrol requeue failed: {e}"
        if warning:
            log.warning("%s", warning)
        return None

    def requeue_exclusions(self) -> List[str]:
        """The nodes a requeued job must not be given: every node excluded so far, and the
        site's own ``cluster.exclude`` (ExcNodeList replaces the submission's --exclude)."""
        return sorted(self._excluded | set(self.cfg.cluster.exclude or ()))

    async def shutdown(self, timeout_s: float) -> None:
        """Wait for every step to end, end what is left, then run the queued scheduler commands."""
        live = [p for p in self._procs.values() if p.returncode is None]
        if live:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=timeout_s)
        for node, p in self._procs.items():
            if p.returncode is None:
                self.kill_worker(f"{node}.0")
        for job in self._companions:  # it would end by itself once this job no longer runs; now is sooner
            self.commands.submit("cancel_job", partial(commands.cancel_job, job), job=job)
        # the queued scancel/scontrol calls: each is bounded by commands.DEFAULT_TIMEOUT_S
        await asyncio.get_running_loop().run_in_executor(None, self.commands.drain, timeout_s + commands.DEFAULT_TIMEOUT_S)
        for t in self._waiters:
            try:
                await asyncio.wait_for(t, timeout=10)
            except asyncio.TimeoutError:
                pass
