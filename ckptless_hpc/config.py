"""Structured config schema (dataclasses registered in Hydra's ConfigStore) and validation.

The Hydra config is the one source of truth: the cluster shape is written once here and every
placement, sbatch line and srun argv is derived from it (``Shape.of``). ``validate`` runs before
anything starts and raises ``ConfigError`` naming the field, the value seen and a hint.

Each component's fields are documented one by one, and each component checks its own fields
in a ``check`` next to them (torchtitan's component configs). They are static methods taking
the section: Hydra composes a ``DictConfig``, which runs no ``__post_init__`` and has no
dataclass methods, so ``validation_errors`` hands each section to its class's ``check``.

This module is the bottom layer and imports nothing of the package but ``metrics`` (its own
layer): what validation needs from higher layers (the layout arithmetic of ``state.placement``,
reading a saved state) is passed in as ``Probes`` by the caller (``launch.probes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

FAULT_KINDS = ("none", "kill_worker", "kill_node", "hang", "slow", "kill_spare", "corrupt_transfer", "truncate_transfer")
FAULT_MOMENTS = ("step", "update", "recovery", "send", "receive", "optimizer", "eval")
DEVICES = ("auto", "cpu", "cuda")  # cluster.device (train/cuda.py resolves them)
COMMS = ("auto", "gloo", "nccl")  # cluster.comm
PRECISIONS = ("fp32", "bf16", "fp16")
NONFINITE_POLICIES = ("stop", "skip")
PARALLEL_MODES = ("ddp", "zero", "fsdp", "hsdp", "tp", "pp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # parallel.pp_schedule (train/pp.py)
MP_DTYPES = ("bf16", "fp16", "fp32")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # train.compile_backend  # parallel.param_dtype / reduce_dtype (FSDP2's MixedPrecisionPolicy)
REDUCTIONS = ("auto", "allreduce", "fixed")
GROW = ("allocation", "job")  # cluster.grow: where replacement nodes come from
ELASTIC_MODES = ("ddp", "zero")  # parallel modes a job can shrink in (cluster.min_nodes < cluster.nodes)


#: A worker silent this long is hung: a larger cluster.heartbeat_timeout_s would turn hang detection off.
MAX_HEARTBEAT_TIMEOUT_S = 3600.0

#: ``need(ok, field, value, problem, hint)`` records a problem unless ``ok`` (see ``validation_errors``).
Need = Callable[[bool, str, Any, str, str], None]


class ConfigError(ValueError):
    """Invalid configuration; the message names the field, the value seen and a HINT."""


@dataclass(frozen=True)
class Shape:
    """The job's shape, derived once from ``cluster``: ranks are numbered node by node, so rank
    ``r`` runs on node slot ``r // workers_per_node``."""

    nodes: int
    workers_per_node: int
    spare_nodes: int

    @classmethod
    def of(cls, cfg: Any) -> "Shape":
        """From a config (or its ``cluster`` section); never raises, even on values ``validate`` refuses."""
        c = cfg.cluster if hasattr(cfg, "cluster") else cfg
        return cls(int(c.nodes), int(c.workers_per_node), int(c.spare_nodes))

    @property
    def world(self) -> int:
        """Ranks that train: ``nodes x workers_per_node`` (spares hold no rank)."""
        return self.nodes * self.workers_per_node

    def node_of(self, rank: int) -> int:
        """The node slot (0..nodes-1) of ``rank``."""
        return rank // self.workers_per_node

    def ranks_of(self, node: int) -> List[int]:
        """The ranks of node slot ``node``, in order."""
        return list(range(node * self.workers_per_node, (node + 1) * self.workers_per_node))


@dataclass(frozen=True)
class Probes:
    """What validation needs from the layers above this one, passed in by the caller so that
    this module imports none of them. A check whose probe is missing is skipped.

    ``hsdp_tolerance(world, workers_per_node, shard_size)``: the node losses an hsdp layout survives;
    ``read_resume(path, shards)``: ``(record, None)`` of a saved state a job can resume from, or
    ``(None, why)`` when it cannot be read."""

    hsdp_tolerance: Optional[Callable[[int, int, int], int]] = None
    read_resume: Optional[Callable[[str, int], Tuple[Optional[Dict[str, Any]], Optional[str]]]] = None


def _err(field_name: str, value: Any, problem: str, hint: str) -> str:
    return f"{field_name}={value!r}: {problem}. HINT: {hint}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """All data, RNG and init derive from (seed, step, rank)."""
    threads: int = 1
    """Torch intra-op threads per worker (fixed: results depend on it)."""
    log_every: int = 10
    """A console line every N steps (events.jsonl gets every step)."""
    console_rank: Optional[int] = 0
    """Whose log lines the console echoes next to the coordinator's (null: none)."""
    grad_accum: int = 1
    """Micro-batches per rank per step; the gradient is reduced once per step."""
    clip_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this (null: no clipping)."""
    precision: str = "fp32"
    """fp32 | bf16 (autocast) | fp16 (autocast + GradScaler)."""
    on_nonfinite: str = "stop"
    """A non-finite loss / grad norm: stop (keep the last finite state, exit 7) | skip."""
    max_skipped_fraction: float = 0.1
    """on_nonfinite=skip drops at most this fraction of train.steps; the next one stops the job (exit 7)."""
    data_workers: int = 0
    """DataLoader worker processes per rank (0: batches made in the training thread)."""
    prefetch: int = 2
    """Micro-batches each data worker prepares ahead."""
    bucket_mb: float = 16.0
    """Gradient allreduce bucket size (MiB): ddp's buckets, and tp's and pp's sums over the replicate group."""
    reduction: str = "auto"
    """How gradients are summed over the ranks: allreduce (bucketed, overlapped with backward) |
    fixed (one fixed tree over the ranks: the same bits whatever the number of processes, what
    a job that shrinks needs; train/fixed.py) | auto (fixed when cluster.min_nodes < cluster.nodes)."""
    tensorboard: bool = False
    """Write loss, LR, grad norm, throughput and recoveries to <run dir>/tensorboard."""
    save_final: bool = True
    """On completion: <run dir>/final/model.pt (the full model) and final/state/ (the whole training state)."""
    save_every: int = 0
    """A durable copy of the committed state every N steps, written in the background to <run dir>/saved/step<S>/ (0: none)."""
    save_every_s: float = 0.0
    """Also a copy every S seconds (at a step the coordinator names a little ahead; 0: none)."""
    keep_saved: int = 2
    """The newest copies of train.save_every kept; older ones are deleted."""
    eval_every: int = 0
    """Evaluate every N steps and at the end (the task's evaluate(); 0: never)."""
    eval_batches: int = 8
    """Validation batches per evaluation, spread over the ranks (a multiple of the world size wastes none)."""
    compile: bool = False
    """torch.compile the model (ddp, zero, fsdp): the task's loss and evaluate run the compiled module; the state keeps the model's own names."""
    compile_backend: str = "inductor"
    """train.compile's backend: inductor (generated kernels) | aot_eager (traced, no code generation: fast to start) | eager."""
    stall_timeout_s: Optional[float] = None
    """End the job when it commits no step for this long while it trains (null: 50 x the median step time, at least 120 s)."""

    @staticmethod
    def check(t: Any, need: Need, shape: Shape) -> None:
        """train.*: the run's length and logging, then the step's options (``check_step``)."""
        need(t.steps >= 1, "train.steps", t.steps, "must be >= 1", "set train.steps=100")
        need(t.threads >= 1, "train.threads", t.threads, "must be >= 1", "set train.threads=1")
        need(t.log_every >= 1, "train.log_every", t.log_every, "must be >= 1", "set train.log_every=10")
        world = shape.world
        need(
            t.console_rank is None or world < 1 or 0 <= t.console_rank < world,  # world < 1: reported above
            "train.console_rank",
            t.console_rank,
            f"must be a rank of the job (0..{world - 1}) or null",
            "set train.console_rank=0, or train.console_rank=null to show only the coordinator",
        )
        need(t.seed >= 0, "train.seed", t.seed, "must be >= 0", "use a non-negative integer seed")
        TrainConfig.check_step(t, need)

    @staticmethod
    def check_step(t: Any, need: Need) -> None:
        """The step's options: accumulation, clipping, precision, non-finite policy, data, copies, evaluation."""
        need(_is_int(t.grad_accum) and t.grad_accum >= 1, "train.grad_accum", t.grad_accum, "must be an integer >= 1", "1 = no accumulation; 4 = four micro-batches per step")
        clip = t.clip_grad_norm
        need(
            clip is None or (isinstance(clip, (int, float)) and clip > 0),
            "train.clip_grad_norm",
            clip,
            "must be > 0 or null",
            "e.g. train.clip_grad_norm=1.0; null turns clipping off",
        )
        need(t.precision in PRECISIONS, "train.precision", t.precision, "unknown precision", f"use one of {', '.join(PRECISIONS)}")
        need(
            t.on_nonfinite in NONFINITE_POLICIES, "train.on_nonfinite", t.on_nonfinite, "unknown policy", "use stop (end the job at the last finite state) or skip (drop the step)"
        )
        f = t.max_skipped_fraction
        need(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f <= 1,
            "train.max_skipped_fraction",
            f,
            "must be in [0, 1]",
            "e.g. train.max_skipped_fraction=0.1 (on_nonfinite=skip drops at most 10% of train.steps); 1.0 sets no limit",
        )
        need(
            _is_int(t.data_workers) and t.data_workers >= 0,
            "train.data_workers",
            t.data_workers,
            "must be an integer >= 0",
            "0 makes batches in the training thread; 2 runs a DataLoader with 2 worker processes",
        )
        need(_is_int(t.prefetch) and t.prefetch >= 1, "train.prefetch", t.prefetch, "must be an integer >= 1", "e.g. train.prefetch=2 micro-batches per data worker")
        need(
            _is_int(t.save_every) and t.save_every >= 0, "train.save_every", t.save_every, "must be an integer >= 0", "e.g. train.save_every=500 (steps); 0 writes no periodic copy"
        )
        need(t.save_every_s >= 0, "train.save_every_s", t.save_every_s, "must be >= 0", "e.g. train.save_every_s=1800 (seconds); 0 writes no timed copy")
        need(_is_int(t.keep_saved) and t.keep_saved >= 1, "train.keep_saved", t.keep_saved, "must be an integer >= 1", "e.g. train.keep_saved=2 (the newest copies kept)")
        backend = getattr(t, "compile_backend", "inductor")
        need(backend in COMPILE_BACKENDS, "train.compile_backend", backend, "unknown backend", f"use one of {', '.join(COMPILE_BACKENDS)}")
        stall = getattr(t, "stall_timeout_s", None)
        need(
            stall is None or (isinstance(stall, (int, float)) and not isinstance(stall, bool) and stall > 0),
            "train.stall_timeout_s",
            stall,
            "must be > 0 or null",
            "e.g. train.stall_timeout_s=1800; null ends a job that commits no step for 50 x its median step time (at least 120 s)",
        )
        need(_is_int(t.eval_every) and t.eval_every >= 0, "train.eval_every", t.eval_every, "must be an integer >= 0", "e.g. train.eval_every=100; 0 turns evaluation off")
        need(
            _is_int(t.eval_batches) and t.eval_batches >= 1,
            "train.eval_batches",
            t.eval_batches,
            "must be an integer >= 1",
            "e.g. train.eval_batches=8 validation batches per evaluation",
        )
        need(t.bucket_mb > 0, "train.bucket_mb", t.bucket_mb, "must be > 0", "e.g. train.bucket_mb=16 (MiB per gradient allreduce)")
        need(t.reduction in REDUCTIONS, "train.reduction", t.reduction, "unknown reduction", f"use one of {', '.join(REDUCTIONS)}")
        if t.tensorboard:
            from .metrics import tensorboard_missing  # the bottom layer, as this module

            why = tensorboard_missing()
            need(why is None, "train.tensorboard", t.tensorboard, str(why), "pip install -e '.[tensorboard]', or set train.tensorboard=false")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at train.steps."""

    @staticmethod
    def check(o: Any, need: Need) -> None:
        """optim.*: a schedule that can run."""
        need(o.lr > 0, "optim.lr", o.lr, "must be > 0", "e.g. optim.lr=3e-4")
        need(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0", "e.g. optim.warmup_steps=10")
        need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]", "e.g. optim.min_lr_ratio=0.1")


@dataclass
class ClusterConfig:
    """Shape of the job and fault-tolerance timings (shared by every backend)."""

    backend: str = "local"
    """local | slurm: set by the config group (cluster=local, cluster=slurm)."""
    nodes: int = 2
    """Worker nodes."""
    workers_per_node: int = 1
    """Ranks per node."""
    spare_nodes: int = 1
    """Hot-spare nodes started with the job."""
    min_nodes: Optional[int] = None
    """Elastic: with no spare left, a node loss shrinks the job while at least this many worker
    nodes live (the survivors also train the lost ranks' micro-batches: same global batch, same
    result) instead of stopping it (null: cluster.nodes, never shrink)."""
    start_nodes: Optional[int] = None
    """Elastic: start on this many of the cluster.nodes worker nodes (cluster.min_nodes..cluster.nodes;
    null: all of them). The started ones also train the others' ranks (the same result as the whole
    layout) until replacement nodes come (refills, cluster.grow); on Slurm the job asks for only
    these nodes (plus spares)."""
    refill_spares: bool = True
    """Launch a new spare node in the background after a promotion."""
    grow: str = "allocation"
    """Where replacement nodes come from (refills, and a shrunk job growing back): allocation (a
    free node of the job's own allocation; locally a new one) | job (Slurm: when the allocation
    has none free, a companion Slurm job of replacement nodes, whose workers join this job)."""
    max_refills: int = 4
    """At most this many spare nodes launched after start (local backend)."""
    bind_host: str = "127.0.0.1"
    """Address services bind to and advertise (never 0.0.0.0 by default)."""
    control: str = "rank"
    """Control connections: rank (one per worker) | node (one per node, through the node's relay: relay.py)."""
    device: str = "auto"
    """auto (CUDA where torch sees a GPU, else CPU) | cpu | cuda."""
    comm: str = "auto"
    """Collectives: auto (nccl on CUDA, gloo on CPU) | gloo | nccl."""
    gpus_per_node: int = 0
    """GPUs per node (Slurm: --gpus-per-node); 0 = every visible GPU. One NCCL rank per GPU."""
    abort_timeout_s: float = 10.0
    """Bound on aborting a broken NCCL communicator and on the CUDA stream check."""
    heartbeat_interval_s: float = 0.5
    """Workers beat this often."""
    heartbeat_timeout_s: float = 3.0
    """A worker silent this long is declared hung."""
    straggler_factor: float = 3.0
    """A rank this many times slower than the typical rank is reported."""
    straggler_action: str = "report"
    """report (an event) | replace (also handed to a hot spare at the next step boundary, its node excluded: docs/failure-semantics.md)."""
    collective_timeout_s: float = 120.0
    """Last-resort bound on one collective (hangs are normally cut by the coordinator)."""
    recovery_timeout_s: float = 60.0
    """Bound on each recovery phase (hold, re-form, transfer)."""
    params_first: bool = True
    """ddp: a replacement fetches parameters first and the optimizer state behind its first step."""
    fetch_parallel: int = 4
    """A replacement fetches disjoint parts of its state from up to this many sources at once."""
    gloo_lazy_connect: bool = False
    """Gloo connects a new generation's pairs on first use (TORCH_GLOO_LAZY_INIT) instead of at formation."""
    startup_timeout_s: float = 300.0
    """Workers must connect and build the model within this."""
    exit_timeout_s: float = 10.0
    """At the end, workers still running this long after their stop are killed."""

    @staticmethod
    def check(c: Any, need: Need) -> None:
        """cluster.*: the shape, the devices and collectives, the timings."""
        need(c.backend in ("local", "slurm"), "cluster.backend", c.backend, "unknown backend", "use cluster=local or cluster=slurm")
        need(c.grow in GROW, "cluster.grow", c.grow, "unknown source of replacement nodes", f"use one of {', '.join(GROW)}")
        need(
            c.grow != "job" or c.backend == "slurm",
            "cluster.grow",
            c.grow,
            "a companion job of replacement nodes is a Slurm job",
            "use cluster=slurm, or cluster.grow=allocation (locally a refill is a new node anyway)",
        )
        need(
            c.control in ("rank", "node"),
            "cluster.control",
            c.control,
            "must be rank or node",
            "cluster.control=rank (a control connection per worker) or cluster.control=node (one per node, through its relay)",
        )
        need(c.nodes >= 1, "cluster.nodes", c.nodes, "must be >= 1", "set cluster.nodes=2")
        need(c.workers_per_node >= 1, "cluster.workers_per_node", c.workers_per_node, "must be >= 1", "set cluster.workers_per_node=1")
        need(c.spare_nodes >= 0, "cluster.spare_nodes", c.spare_nodes, "must be >= 0", "set cluster.spare_nodes=1 (0 = no hot spares)")
        m = c.min_nodes
        need(
            m is None or (_is_int(m) and 1 <= m <= c.nodes),
            "cluster.min_nodes",
            m,
            f"must be an integer in 1..cluster.nodes={c.nodes}, or null",
            f"e.g. cluster.min_nodes={max(1, c.nodes - 1)} (shrink by one node at most); null never shrinks",
        )
        s = c.start_nodes
        need(
            s is None or (_is_int(s) and min_nodes(c) <= s <= c.nodes),
            "cluster.start_nodes",
            s,
            f"must be an integer in cluster.min_nodes..cluster.nodes ({min_nodes(c)}..{c.nodes}), or null",
            "a job that starts on fewer nodes than its layout is a shrunk job: set cluster.min_nodes to at most cluster.start_nodes, or leave cluster.start_nodes=null",
        )
        need(c.straggler_factor > 1, "cluster.straggler_factor", c.straggler_factor, "must be > 1", "e.g. cluster.straggler_factor=3")
        need(
            c.straggler_action in ("report", "replace"),
            "cluster.straggler_action",
            c.straggler_action,
            "must be report or replace",
            "cluster.straggler_action=report (an event only) or cluster.straggler_action=replace (move a straggler's node to a spare)",
        )
        ClusterConfig.check_devices(c, need)
        need(c.abort_timeout_s > 0, "cluster.abort_timeout_s", c.abort_timeout_s, "must be > 0", "e.g. cluster.abort_timeout_s=10")
        need(
            isinstance(c.fetch_parallel, int) and c.fetch_parallel >= 1,
            "cluster.fetch_parallel",
            c.fetch_parallel,
            "must be an integer >= 1",
            "e.g. cluster.fetch_parallel=4 (1: one source at a time)",
        )
        need(c.max_refills >= 0, "cluster.max_refills", c.max_refills, "must be >= 0", "set cluster.max_refills=0 to never refill")
        ClusterConfig.check_timings(c, need)

    @staticmethod
    def check_devices(c: Any, need: Need) -> None:
        """cluster.device, cluster.comm, cluster.gpus_per_node: NCCL's one rank per GPU."""
        need(c.device in DEVICES, "cluster.device", c.device, "unknown device", "use auto, cpu or cuda")
        need(c.comm in COMMS, "cluster.comm", c.comm, "unknown collective backend", "use auto, gloo or nccl")
        need(not (c.comm == "nccl" and c.device == "cpu"), "cluster.comm", c.comm, "nccl needs CUDA devices", "set cluster.device=cuda, or cluster.comm=gloo on CPU")
        need(c.gpus_per_node >= 0, "cluster.gpus_per_node", c.gpus_per_node, "must be >= 0", "0 = every GPU the node shows")
        need(
            not (c.gpus_per_node > 0 and c.device != "cpu" and c.comm != "gloo" and c.workers_per_node > c.gpus_per_node),
            "cluster.workers_per_node",
            c.workers_per_node,
            f"puts {c.workers_per_node} NCCL ranks on cluster.gpus_per_node={c.gpus_per_node} GPUs: NCCL refuses two ranks on one device",
            f"set cluster.workers_per_node={c.gpus_per_node} (one rank per GPU), or cluster.comm=gloo to share GPUs",
        )
        need(
            not (c.backend == "local" and c.comm == "nccl" and c.nodes > 1),
            "cluster.comm",
            c.comm,
            f"cluster=local runs its {c.nodes} nodes on this machine, where their NCCL ranks would share GPUs (NCCL refuses two ranks on one device)",
            "set cluster.nodes=1 with cluster.workers_per_node=<GPUs>, or cluster.comm=gloo (ranks share GPUs through host memory)",
        )

    @staticmethod
    def check_timings(c: Any, need: Need) -> None:
        """The heartbeat and the bounds: finite, positive, and hang detection kept on."""
        need(c.heartbeat_interval_s > 0, "cluster.heartbeat_interval_s", c.heartbeat_interval_s, "must be > 0", "0.5 is a good default")
        need(
            math.isfinite(c.heartbeat_timeout_s) and c.heartbeat_timeout_s <= MAX_HEARTBEAT_TIMEOUT_S,
            "cluster.heartbeat_timeout_s",
            c.heartbeat_timeout_s,
            f"must be at most {MAX_HEARTBEAT_TIMEOUT_S:.0f} s: a larger value turns hang detection off (a hung worker would stall the job that long)",
            "keep the default 3.0, or a few times the longest pause a worker's heartbeat thread can see (e.g. 30)",
        )
        need(
            c.heartbeat_timeout_s >= 2 * c.heartbeat_interval_s,
            "cluster.heartbeat_timeout_s",
            c.heartbeat_timeout_s,
            f"must be at least twice cluster.heartbeat_interval_s={c.heartbeat_interval_s}",
            "raise cluster.heartbeat_timeout_s (default 3.0) or lower the interval",
        )
        for name in ("collective_timeout_s", "recovery_timeout_s", "startup_timeout_s", "exit_timeout_s"):
            v = getattr(c, name)
            need(v > 0 and math.isfinite(v), f"cluster.{name}", v, "must be a finite number > 0", "use a positive number of seconds (no inf: it would wait forever)")


@dataclass
class LocalClusterConfig(ClusterConfig):
    backend: str = "local"
    """Worker processes on this machine."""


@dataclass
class SlurmClusterConfig(ClusterConfig):
    backend: str = "slurm"
    """One srun step per node inside a Slurm allocation."""
    submit: bool = True
    """False: run the coordinator in the current allocation (slurm/train.sbatch)."""
    partition: Optional[str] = None
    """--partition."""
    account: Optional[str] = None
    """--account."""
    qos: Optional[str] = None
    """--qos."""
    constraint: Optional[str] = None
    """--constraint."""
    time_min: int = 60
    """--time in minutes."""
    cpus_per_task: int = 0
    """--cpus-per-task (0 = Slurm's default)."""
    mem_gb: int = 0
    """--mem in GB (0 = unset)."""
    exclude: List[str] = field(default_factory=list)
    """Nodes never to run on (--exclude)."""
    signal_delay_s: int = 120
    """The warning signal (B:USR2) comes this long before the time limit: the emergency copy and the requeue."""
    drain_failed_nodes: bool = False
    """Also drain failed nodes through scontrol (needs the permission)."""
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    """Extra sbatch options, e.g. {mail-type: END} (options the shape owns are refused)."""
    setup: List[str] = field(default_factory=list)
    """Shell lines run in the batch script before the coordinator (e.g. module load cuda)."""
    max_requeues: int = 3
    """A job stops instead of requeueing after this many requeues."""

    @staticmethod
    def check_allocation(c: Any, need: Need) -> None:
        """The Slurm fields (cluster=slurm only): a time limit and a warning before it."""
        need(c.time_min >= 1, "cluster.time_min", c.time_min, "must be >= 1", "the job's time limit in minutes")
        need(c.signal_delay_s >= 0, "cluster.signal_delay_s", c.signal_delay_s, "must be >= 0", "seconds of warning before the end")


@dataclass
class ParallelConfig:
    """How the model's state is laid out over the ranks (docs/sharding.md)."""

    mode: str = "ddp"
    """ddp: every rank holds all of it | zero: optimizer state sharded over the ranks |
    fsdp: parameters, gradients and optimizer state sharded (FSDP2) | hsdp: FSDP2 within a
    shard group of shard_size ranks, replicated across groups placed on different nodes | tp:
    tensor parallel in groups of tp ranks (the task's plan), replicated across groups | pp:
    pipelines of pp stages (the task's split), replicated across pipelines."""
    shard_size: Optional[int] = None
    """hsdp: ranks per shard group (world must be a multiple); tp: FSDP2 over this many TP groups inside each replica (a replica: shard_size x tp ranks, rank r*S*T + s*T + t; null or 1: tensor parallel alone)."""
    tp: Optional[int] = None
    """tp: ranks per tensor-parallel group, one replica of the model (world must be a multiple; the task gives the plan: Task.tp_plan); pp: each stage tensor-parallel over tp ranks (a replica: pp x tp ranks, rank r*pp*tp + s*tp + t)."""
    pp: Optional[int] = None
    """pp: stages per pipeline, one replica of the model on pp ranks (world must be a multiple; the task gives the stages: Task.pp_stage, pp_split, pp_loss; with train.eval_every, pp_evaluate)."""
    pp_schedule: str = "gpipe"
    """pp: torch.distributed.pipelining's schedule, gpipe | 1f1b (needs train.grad_accum >= parallel.pp) | interleaved_1f1b (parallel.pp_virtual stages per rank; train.grad_accum at most parallel.pp, or a multiple of train.grad_accum // parallel.pp); the micro-batches are train.grad_accum's."""
    pp_virtual: int = 1
    """pp: stages per rank (pipelines of pp x pp_virtual stages, rank s of a pipeline holding stages s, s+pp, ...); more than 1 needs pp_schedule=interleaved_1f1b, which needs 2 or more."""
    param_dtype: Optional[str] = None
    """fsdp|hsdp|tp x shard: FSDP2's MixedPrecisionPolicy param_dtype, the dtype parameters are gathered and computed in (null: theirs; bf16 | fp16 | fp32)."""
    reduce_dtype: Optional[str] = None
    """fsdp|hsdp|tp x shard: MixedPrecisionPolicy reduce_dtype, the dtype gradients are reduced in (null: param_dtype's; bf16 | fp16 | fp32)."""

    @staticmethod
    def check(cfg: Any, need: Need, shape: Shape, probes: "Probes") -> None:
        """parallel.* and replication.*: the layout must be possible, and the promise it makes
        (how many node losses the job survives) must be one it can keep."""
        p = getattr(cfg, "parallel", None)
        if p is None:
            return
        c, t = cfg.cluster, cfg.train
        if p.mode not in PARALLEL_MODES:
            need(False, "parallel.mode", p.mode, "unknown parallel mode", f"use parallel={'|'.join(PARALLEL_MODES)}")
            return
        r = cfg.replication
        ReplicationConfig.check(r, need)
        if min_nodes(cfg) < c.nodes:
            need(
                p.mode in ELASTIC_MODES,
                "cluster.min_nodes",
                c.min_nodes,
                f"a job of parallel.mode={p.mode} cannot shrink yet: "
                + (
                    "its replicas would have to go on without a whole TP group or pipeline, which is not built yet"
                    if p.mode in ("tp", "pp")
                    else "FSDP2's parameters are sharded over the processes, so the survivors would have to re-shard the model"
                ),
                "use parallel=ddp or zero to shrink, or leave cluster.min_nodes=null (a loss past the spares stops the job: docs/failure-semantics.md)",
            )
            need(
                t.reduction != "allreduce",
                "train.reduction",
                t.reduction,
                f"cluster.min_nodes={c.min_nodes} < cluster.nodes={c.nodes} needs the fixed-order reduction: gloo's and NCCL's all-reduce add in an order that depends on the number of processes, so a shrunk job would drift from the fault-free one",
                "set train.reduction=fixed (or auto)",
            )
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(p, name, None)
            need(v is None or v in MP_DTYPES, f"parallel.{name}", v, "unknown dtype", f"use one of {', '.join(MP_DTYPES)}, or null")
            tp_shard = p.mode == "tp" and p.get("shard_size") not in (None, 1)
            need(
                v not in MP_DTYPES or p.mode in ("fsdp", "hsdp") or tp_shard,
                f"parallel.{name}",
                v,
                f"FSDP2's MixedPrecisionPolicy is for parallel=fsdp|hsdp and tp x shard (parallel.shard_size > 1), not {p.mode}" + (" alone" if p.mode == "tp" else ""),
                "use train.precision=bf16 (autocast) with ddp, zero, tp or pp, or parallel=fsdp, or parallel.shard_size=2 under tp",
            )
        if p.mode == "ddp":
            return
        need(
            t.precision != "fp16",
            "train.precision",
            t.precision,
            f"fp16 with a grad scaler is not supported with parallel.mode={p.mode} (each rank would judge overflow on its own shard only)",
            "use train.precision=bf16 (no scaler needed) or fp32, or parallel=ddp for fp16",
        )
        if p.mode == "hsdp":
            ParallelConfig.check_hsdp(p.shard_size, need, shape, probes)
            return
        if p.mode == "tp":
            ParallelConfig.check_tp_shard(p, r, need, shape, probes)
            need(
                p.get("pp") is None,
                "parallel.pp",
                p.get("pp"),
                "parallel=tp has no pipeline",
                f"for pipelines of TP groups use parallel=pp parallel.pp={p.get('pp')} parallel.tp={p.get('tp')}, or leave parallel.pp unset",
            )
            return
        if p.mode == "pp":
            ParallelConfig.check_pp(p, t, r, need, shape, probes)
            return
        if _is_int(r.factor) and r.factor >= 1:
            need(
                r.factor <= c.nodes - 1,
                "replication.factor",
                r.factor,
                f"each copy must live on a node other than its owner's and the job has {c.nodes} node(s): at most {c.nodes - 1} copies",
                f"set replication.factor={max(0, c.nodes - 1)}, or raise cluster.nodes",
            )

    @staticmethod
    def check_groups(s: Any, r: Any, need: Need, shape: Shape, probes: "Probes", field: str, what: str) -> None:
        """tp and pp: a group size dividing the world into replicas on different nodes (each
        coordinate's shard held by every replica), or one replica whose ranks' shards are copied
        to peers on other nodes (``replication.factor``, as zero's and fsdp's)."""
        if _is_int(s) and s >= 1 and s == shape.world:
            need(
                _is_int(r.factor) and 1 <= r.factor <= shape.nodes - 1,
                "replication.factor",
                r.factor,
                f"{field}={s} makes the whole world one replica, so each rank's shard exists nowhere else unless copied to a peer on another node "
                f"(cluster.nodes={shape.nodes}: at most {max(0, shape.nodes - 1)} copies)",
                f"set replication.factor=1 with cluster.nodes=2 or more, or {field}={max(1, shape.world // 2)} for two replicas",
            )
            return
        ParallelConfig.check_hsdp(s, need, shape, probes, field=field, what=what)

    @staticmethod
    def check_tp_shard(p: Any, r: Any, need: Need, shape: Shape, probes: "Probes") -> None:
        """parallel=tp: a TP group size, and with ``parallel.shard_size`` > 1 FSDP2 over that many
        TP groups inside each replica (a replica: shard_size x tp ranks)."""
        s = p.get("shard_size")
        if s is not None and not (_is_int(s) and s >= 1):
            need(
                False,
                "parallel.shard_size",
                s,
                "must be null or an integer >= 1 (under parallel=tp: the TP groups of a replica that FSDP2 shards the model over)",
                "set parallel.shard_size=2, or null for tensor parallel alone",
            )
        elif _is_int(s) and s > 1 and _is_int(p.get("tp")) and p.tp >= 1:
            ParallelConfig.check_groups(group_size(p), r, need, shape, probes, field="parallel.shard_size x parallel.tp", what="tp x shard needs a replica (shard_size x tp ranks)")
        else:
            ParallelConfig.check_groups(p.get("tp"), r, need, shape, probes, field="parallel.tp", what="tp needs a tensor-parallel group size")

    @staticmethod
    def check_pp(p: Any, t: Any, r: Any, need: Need, shape: Shape, probes: "Probes") -> None:
        """parallel=pp: a pipeline size dividing the world into replicas on different nodes (as
        hsdp's shard groups), a schedule torch has, enough micro-batches for 1F1B, and nothing
        the pipeline does not carry (torch.compile)."""
        tp = p.get("tp")
        if tp is not None and not (_is_int(tp) and tp >= 1):
            need(
                False,
                "parallel.tp",
                tp,
                "must be null or an integer >= 1 (under parallel=pp: ranks per tensor-parallel group of each stage)",
                "set parallel.tp=2, or null for no TP",
            )
        shard = p.get("shard_size")
        if shard not in (None, 1):  # pp x shard: FSDP2 over the same stage of a replica's pipelines
            need(
                _is_int(shard) and shard >= 2,
                "parallel.shard_size",
                shard,
                "must be null or an integer >= 1 (under parallel=pp: pipelines per replica, FSDP2 over each stage's)",
                "set parallel.shard_size=2, or null",
            )
            need(
                p.get("pp_virtual", 1) in (None, 1),
                "parallel.pp_virtual",
                p.get("pp_virtual"),
                "pp x shard runs one stage per rank (interleaved stages under FSDP2 are not built)",
                "set parallel.pp_virtual=1 and parallel.pp_schedule=gpipe|1f1b",
            )
            if _is_int(shard) and shard >= 2 and _is_int(p.get("pp")):
                dims = "pp x shard_size x tp" if _is_int(tp) and tp > 1 else "pp x shard_size"
                field = "parallel." + dims.replace(" x ", " x parallel.")
                ParallelConfig.check_groups(group_size(p), r, need, shape, probes, field=field, what=f"pp x shard needs a replica ({dims} ranks)")
        elif _is_int(tp) and tp > 1 and _is_int(p.get("pp")):  # pp x tp: a replica is pp x tp ranks
            ParallelConfig.check_groups(group_size(p), r, need, shape, probes, field="parallel.pp x parallel.tp", what="pp x tp needs a replica (pp x tp ranks)")
        else:
            ParallelConfig.check_groups(p.get("pp"), r, need, shape, probes, field="parallel.pp", what="pp needs a pipeline size (stages per replica)")
        sched = p.get("pp_schedule", "gpipe")
        need(sched in PP_SCHEDULES, "parallel.pp_schedule", sched, "unknown pipeline schedule", f"use one of {', '.join(PP_SCHEDULES)}")
        if sched == "1f1b" and _is_int(p.get("pp")) and _is_int(t.grad_accum):
            need(
                t.grad_accum >= p.pp,
                "train.grad_accum",
                t.grad_accum,
                f"parallel.pp_schedule=1f1b needs at least as many micro-batches as stages (parallel.pp={p.pp})",
                f"set train.grad_accum={p.pp} or more, or parallel.pp_schedule=gpipe",
            )
        ParallelConfig.check_pp_virtual(p, t, need)
        need(
            not t.get("compile", False),
            "train.compile",
            t.get("compile"),
            "parallel=pp runs the stages' own modules, not a compiled one",
            "set train.compile=false",
        )

    @staticmethod
    def check_pp_virtual(p: Any, t: Any, need: Need) -> None:
        """parallel.pp_virtual: stages per rank, more than one exactly with interleaved_1f1b, whose
        micro-batches torch takes in rounds of ``grad_accum // pp`` (at least 1) that must divide them."""
        v, sched, pp = p.get("pp_virtual", 1), p.get("pp_schedule", "gpipe"), p.get("pp")
        if not (_is_int(v) and v >= 1):
            need(False, "parallel.pp_virtual", v, "must be an integer >= 1 (stages per rank)", "set parallel.pp_virtual=1, or 2 with parallel.pp_schedule=interleaved_1f1b")
            return
        if sched == "interleaved_1f1b":
            need(
                v >= 2,
                "parallel.pp_virtual",
                v,
                "parallel.pp_schedule=interleaved_1f1b interleaves several stages on each rank",
                "set parallel.pp_virtual=2 (or more; the task's pp_stage then cuts parallel.pp x parallel.pp_virtual stages), or parallel.pp_schedule=1f1b",
            )
            if _is_int(pp) and pp >= 1 and _is_int(t.grad_accum) and t.grad_accum >= 1:
                rounds = max(1, t.grad_accum // pp)
                need(
                    t.grad_accum % rounds == 0,
                    "train.grad_accum",
                    t.grad_accum,
                    f"parallel.pp_schedule=interleaved_1f1b runs the micro-batches in {rounds} rounds (train.grad_accum // parallel.pp={pp}), which must divide them",
                    f"set train.grad_accum to {pp * rounds} (a multiple of parallel.pp) or to at most {pp}",
                )
        elif sched in PP_SCHEDULES:
            need(
                v == 1,
                "parallel.pp_virtual",
                v,
                f"parallel.pp_schedule={sched} runs one stage per rank",
                "set parallel.pp_schedule=interleaved_1f1b for several stages per rank, or parallel.pp_virtual=1",
            )

    @staticmethod
    def check_hsdp(s: Any, need: Need, shape: Shape, probes: "Probes", field: str = "parallel.shard_size", what: str = "hsdp needs a shard group size") -> None:
        """parallel.shard_size under hsdp (parallel.tp under tp): a group size dividing the world
        into replicas on different nodes (the node-loss check needs ``probes.hsdp_tolerance``)."""
        world = shape.world
        ok = _is_int(s) and s >= 1 and world >= 1 and world % s == 0 and world // s >= 2
        need(
            ok,
            field,
            s,
            f"{what} that divides the world size {world} into at least 2 replicas",
            f"e.g. {field}={max(1, world // 2)} (world {world} = cluster.nodes x cluster.workers_per_node)",
        )
        if ok and probes.hsdp_tolerance is not None:
            need(
                probes.hsdp_tolerance(world, shape.workers_per_node, s) >= 1,
                field,
                s,
                f"every replica of some shard lives on one node (cluster.nodes={shape.nodes}, cluster.workers_per_node={shape.workers_per_node}), so one node loss loses it",
                "spread the job over at least 2 nodes (cluster.nodes=2 or more), so that the replicas of a shard sit on different nodes",
            )


@dataclass
class ReplicationConfig:
    """Copies of each rank's unique state (parallel.mode=zero|fsdp) on peers of other nodes."""

    factor: int = 1
    """Copies of each shard, each on a node other than its owner's (0: none; a lost owner ends the job)."""
    every: int = 1
    """Send a copy after every N committed steps (a lost shard rolls the job back to the last copy)."""

    @staticmethod
    def check(r: Any, need: Need) -> None:
        """replication.*: whole numbers (whether the nodes can hold the copies: ``ParallelConfig.check``)."""
        need(_is_int(r.factor) and r.factor >= 0, "replication.factor", r.factor, "must be an integer >= 0", "1 = one copy of each shard on another node")
        need(_is_int(r.every) and r.every >= 1, "replication.every", r.every, "must be an integer >= 1", "1 = a copy after every committed step")


_FAULT_FIELDS = ("kind", "rank", "node", "step", "at", "factor", "duration")
# kinds whose moment is fixed: a straggler slows its steps, a spare dies while it waits, a
# damaged transfer is damaged while it is served
WIRE_KINDS = ("corrupt_transfer", "truncate_transfer")
_AT_IGNORED = {"slow": "step", "kill_spare": "step", "corrupt_transfer": "send", "truncate_transfer": "send"}


@dataclass
class FaultSpec:
    kind: str = "none"
    """kill_worker (SIGKILL) | kill_node (its process group / step) | hang (SIGSTOP) |
    slow (a straggler: ``factor`` times slower for ``duration`` steps) | kill_spare (a waiting spare) |
    corrupt_transfer / truncate_transfer (the next state this rank serves is damaged on the wire)."""
    rank: Optional[int] = None
    """The rank that fails (every kind but kill_node and kill_spare)."""
    node: Optional[int] = None
    """kill_node: the node slot (0..nodes-1) whose node dies."""
    step: int = 10
    """The step at (or after) which it fires."""
    at: str = "step"
    """When a kill/hang fires: "step" (computing ``step``, after backward, before the allreduce),
    "update" (right after ``step``'s optimizer update, before anything else: sharded state's
    consistency window), "recovery" (when a recovery starts), "send" (while serving state to a replacement),
    "eval" (in the first evaluation after ``step`` committed steps: forwards done, all-reduce not launched),
    "receive" (while the worker that took ``rank`` receives its state);
    corrupt/truncate_transfer: "send" (the next state served) or "optimizer" (the next optimizer
    state served: with cluster.params_first, the part a replacement receives behind its first step)."""
    factor: float = 5.0
    """slow: step time multiplier."""
    duration: int = 20
    """slow: for this many steps."""

    @staticmethod
    def check(f: Any, prefix: str, steps: int, shape: Shape) -> List[str]:
        """One fault (``prefix``: fault or fault.schedule[i]): a known kind, at a moment it can
        strike, on a rank or node slot of the job, at a step the run reaches."""
        errors: List[str] = []
        if f.kind not in FAULT_KINDS:
            return [_err(f"{prefix}.kind", f.kind, "unknown fault kind", f"use one of {', '.join(FAULT_KINDS)}")]
        if f.kind == "none":
            return []
        if not 0 <= f.step < steps:
            errors.append(_err(f"{prefix}.step", f.step, f"must be in [0, train.steps={steps})", "pick a step the run reaches"))
        if f.at not in FAULT_MOMENTS:
            errors.append(_err(f"{prefix}.at", f.at, "unknown moment", f"use one of {', '.join(FAULT_MOMENTS)}"))
        elif f.kind in WIRE_KINDS and f.at not in ("step", "send", "optimizer"):
            errors.append(
                _err(f"{prefix}.at", f.at, f"a {f.kind} fault strikes a state being served", f"use {prefix}.at=send (any state) or {prefix}.at=optimizer (its optimizer part)")
            )
        elif f.kind in _AT_IGNORED and f.kind not in WIRE_KINDS and f.at not in ("step", _AT_IGNORED[f.kind]):  # "step" is the schema's default
            errors.append(_err(f"{prefix}.at", f.at, f"a {f.kind} fault always strikes {_AT_IGNORED[f.kind]!r}", f"drop {prefix}.at (or set it to {_AT_IGNORED[f.kind]})"))
        if f.kind == "slow" and (f.factor <= 1 or f.duration < 1):
            errors.append(_err(f"{prefix}.factor", f.factor, "a straggler needs factor > 1 and duration >= 1", "e.g. factor: 5, duration: 20"))
        world = shape.world
        if f.kind not in ("kill_node", "kill_spare"):
            if f.rank is None or not 0 <= f.rank < world:
                errors.append(
                    _err(
                        f"{prefix}.rank",
                        f.rank,
                        f"no such rank (world size {world} = cluster.nodes x cluster.workers_per_node)",
                        f"use {prefix}.rank=0..{world - 1}",
                    )
                )
        if f.kind == "kill_node":
            if f.node is None or not 0 <= f.node < shape.nodes:
                errors.append(_err(f"{prefix}.node", f.node, f"no such node slot (cluster.nodes={shape.nodes})", f"use {prefix}.node=0..{shape.nodes - 1}"))
        return errors


@dataclass
class FaultConfig(FaultSpec):
    schedule: List[FaultSpec] = field(default_factory=list)
    """More faults in the same run, e.g. fault.schedule='[{kind:hang,rank:0,step:30}]'."""

    @staticmethod
    def check_all(fault: Any, steps: int, shape: Shape) -> List[str]:
        """The primary fault, then each of the schedule's."""
        raw = [("fault", fault)] + [(f"fault.schedule[{i}]", f) for i, f in enumerate(fault.schedule or [])]
        return [e for prefix, f in raw for e in FaultSpec.check(f, prefix, steps, shape)]


@dataclass
class Config:
    task: Any = MISSING
    """The task: a config group (lm, mlp) or your own (_target_ and its keyword arguments)."""
    cluster: ClusterConfig = MISSING
    """A config group: local or slurm."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Faults to inject (config group fault=...)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop (TrainConfig)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and its schedule (OptimConfig)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The state's layout over the ranks (config group parallel=...)."""
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    """Copies of sharded state on other nodes (ReplicationConfig)."""
    job_name: str = "ckptless"
    """Slurm job name; also shown in logs."""
    dry_run: bool = False
    """Validate the config and check the task; print the placement (and the Slurm lines); launch nothing."""
    resume_from: Optional[str] = None
    """A run dir, or a final, periodic or emergency copy (its folder or file, or its DCP folder: the copy it was written from): a new job continues from its step."""

    @staticmethod
    def check_resume(cfg: Any, need: Need, probes: "Probes") -> None:
        """resume_from: a saved state this job's layout can load, of a step before train.steps
        (read through ``probes.read_resume``: skipped without it)."""
        resume = cfg.get("resume_from") if hasattr(cfg, "get") else getattr(cfg, "resume_from", None)
        if resume is None or probes.read_resume is None:
            return
        rec, why = probes.read_resume(str(resume), resume_shards(cfg))
        if rec is None:
            need(False, "resume_from", resume, str(why), "give a run directory, its final/ folder, or the file, folder or DCP folder of a saved copy")
            return
        need(
            rec["step"] < cfg.train.steps,
            "resume_from",
            resume,
            f"holds step {rec['step']}, and train.steps={cfg.train.steps}: nothing left to train",
            f"raise train.steps above {rec['step']}",
        )


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    cs.store(group="cluster", name="local_schema", node=LocalClusterConfig)
    cs.store(group="cluster", name="slurm_schema", node=SlurmClusterConfig)
    cs.store(group="fault", name="fault_schema", node=FaultConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)


# ----------------------------------------------------------------------------------------
# validation (pure)


def fault_list(fault: Any) -> List[Dict[str, Any]]:
    """All faults of a run (the primary one and the schedule) as plain dicts, kind != none."""
    items = [fault] + list(fault.schedule or [])
    out = [{k: getattr(f, k, FaultSpec.__dataclass_fields__[k].default) for k in _FAULT_FIELDS} for f in items]
    return [f for f in out if f["kind"] != "none"]


def validation_errors(cfg: Any, probes: Optional[Probes] = None) -> List[str]:
    """Every problem in ``cfg`` (a DictConfig or the dataclass), as readable messages: each
    component's ``check``, in the order of the sections. ``probes``: the checks that need a
    higher layer (``launch.probes.PROBES``); without them those checks are skipped."""
    probes = probes or Probes()
    errors: List[str] = []
    c, t = cfg.cluster, cfg.train
    shape = Shape.of(cfg)

    def need(cond: bool, name: str, value: Any, problem: str, hint: str) -> None:
        if not cond:
            errors.append(_err(name, value, problem, hint))

    ClusterConfig.check(c, need)
    TrainConfig.check(t, need, shape)
    OptimConfig.check(cfg.optim, need)
    if c.backend == "slurm":
        SlurmClusterConfig.check_allocation(c, need)
    errors.extend(FaultConfig.check_all(cfg.fault, cfg.train.steps, shape))
    ParallelConfig.check(cfg, need, shape, probes)
    if not errors:
        Config.check_resume(cfg, need, probes)
    return errors


def start_nodes(cfg: Any) -> int:
    """``cluster.start_nodes``, or ``cluster.nodes`` where it is null (start whole); ``cfg``: a config or its ``cluster`` section."""
    c = cfg.cluster if hasattr(cfg, "cluster") else cfg
    s = getattr(c, "start_nodes", None)
    return int(s) if _is_int(s) else int(c.nodes)


def min_nodes(cfg: Any) -> int:
    """``cluster.min_nodes``, or ``cluster.nodes`` where it is null (never shrink); ``cfg``: a config or its ``cluster`` section."""
    c = cfg.cluster if hasattr(cfg, "cluster") else cfg
    return int(c.min_nodes) if _is_int(c.min_nodes) else int(c.nodes)


def node_losses(cfg: Any) -> str:
    """What node losses the job goes on through: hot spares, then (``cluster.min_nodes``) shrinking."""
    c = cfg.cluster
    spares = int(c.spare_nodes)
    source = "free nodes, then from companion Slurm jobs" if getattr(c, "grow", "allocation") == "job" else "free nodes"
    refills = f" (and up to {c.max_refills} refilled)" if c.backend == "local" and c.refill_spares and c.max_refills else f" (and refills from {source})" if c.refill_spares else ""
    with_spares = f"survives {spares} node loss{'es' if spares != 1 else ''} with spares{refills}"
    m, nodes = min_nodes(cfg), int(c.nodes)
    if m >= nodes:
        return f"node losses: {with_spares}; the next one stops the job (an emergency copy, then a requeue on Slurm; cluster.min_nodes shrinks instead)"
    start = start_nodes(cfg)
    begins = f"starts on {start} of {nodes} nodes (cluster.start_nodes) and grows when nodes come; " if start < nodes else ""
    return f"{begins}node losses: {with_spares}, then shrinks to {m} of {nodes} nodes (train.reduction=fixed: the same bits), and grows back when a node is there again"


def reduction(cfg: Any) -> str:
    """``train.reduction`` resolved: ``fixed`` or ``allreduce`` (``auto``: fixed for a job that can shrink)."""
    r = str(cfg.train.reduction)
    if r == "auto":
        return "fixed" if min_nodes(cfg) < int(cfg.cluster.nodes) else "allreduce"
    return r


def resume_shards(cfg: Any) -> int:
    """Files of a saved state for this layout: one (ddp) or one per shard."""
    mode, world = cfg.parallel.mode, Shape.of(cfg).world
    return {"ddp": 1, "zero": world, "fsdp": world}.get(mode, group_size(cfg.parallel) or 1)


def group_size(parallel: Any) -> Optional[int]:
    """Ranks per replica group of a ``parallel`` config: hsdp's shard_size, tp's tp (tp x shard:
    shard_size * tp, a replica's TP groups that FSDP2 shards over), pp's pp (pp x tp: pp * tp, a
    replica's pipelines of TP groups; pp x shard: pp * shard_size, a replica's pipelines, FSDP2
    over the same stage of each; else None)."""
    mode = str(getattr(parallel, "mode", "ddp"))
    if mode == "pp":
        pp, tp, shard = getattr(parallel, "pp", None), getattr(parallel, "tp", None), getattr(parallel, "shard_size", None)
        inner = pp * tp if _is_int(pp) and _is_int(tp) and tp > 1 else pp  # a pipeline (pp x tp: of TP groups)
        if _is_int(inner) and _is_int(shard) and shard > 1:
            return inner * shard  # pp x shard (x tp): a replica's pipelines, FSDP2 over the same stage of each
        return inner
    if mode == "tp":
        tp, shard = getattr(parallel, "tp", None), getattr(parallel, "shard_size", None)
        return tp * shard if _is_int(tp) and _is_int(shard) and shard > 1 else tp
    return getattr(parallel, "shard_size", None)


def same_batch(parallel: Any) -> int:
    """Ranks of a ``parallel`` config that compute the same batch: a TP group (tp), a replica's
    pipelines of TP groups (pp), a pipeline (pp x shard: each of a replica's pipelines is an FSDP
    rank of its own data); 1 otherwise."""
    mode = str(getattr(parallel, "mode", "ddp"))
    shard = getattr(parallel, "shard_size", None)
    if mode == "pp" and _is_int(shard) and shard > 1:
        size = group_size(parallel) // shard  # a pipeline (of TP groups)
    else:
        size = getattr(parallel, "tp", None) if mode == "tp" else group_size(parallel) if mode == "pp" else None
    return int(size) if _is_int(size) and size >= 1 else 1


def data_world(cfg: Any) -> int:
    """The ranks that each train on a batch of their own: the world, less tensor and pipeline
    parallel's groups (the ranks of one TP group, or of one pipeline, compute the same batch)."""
    p = cfg.get("parallel") if hasattr(cfg, "get") else None
    return Shape.of(cfg).world // (same_batch(p) if p is not None else 1)


def global_batch(cfg: Any, batch_size: Any = None) -> str:
    """The start line's ``global batch: batch_size B x grad_accum K x world W = N samples per step``
    (``batch_size``: the task's, when the caller knows it; else the task config's, if it has one;
    W: :func:`data_world`)."""
    k = int(cfg.train.grad_accum)
    world = data_world(cfg)
    task = cfg.get("task")
    bs = batch_size if batch_size is not None else (task.get("batch_size") if task is not None else None)
    if not _is_int(bs):
        return f"global batch: the task's batch size x grad_accum {k} x world {world} samples per step"
    return f"global batch: batch_size {bs} x grad_accum {k} x world {world} = {bs * k * world} samples per step"


def validate(cfg: Any, probes: Optional[Probes] = None) -> None:
    """Raise ``ConfigError`` listing every problem (``validation_errors``)."""
    errors = validation_errors(cfg, probes)
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
