"""The GPU path's pure parts: which device a worker uses, the NCCL environment the framework
needs, the settings that make CUDA results reproducible, and which CUDA errors poison a process.

Facts behind the environment (torch 2.13's ProcessGroupNCCL, see docs/gpu.md):
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3: a failed collective tears the process
  down. The framework aborts a broken generation's communicator itself, so it sets 0.
- The watchdog writes an ``exception_dump`` key into the root store on any failed work and a
  process's first NCCL group polls it and ``std::abort``s minutes later; the job's store is
  shared across generations, so a spare started later would kill itself: dumps and monitoring
  off.
- Bitwise reductions: one algorithm and protocol for every reduction (Ring, Simple).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

# variable -> (value the framework needs, why); a user's different value is reported, not kept
NCCL_ENV: Dict[str, Tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0", "a failed collective must not tear the process down: the framework aborts the communicator and re-forms"),
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": ("250", "the watchdog's sleep before it acts (default 60 s x 4)"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0", "a dump key in the shared store makes later processes abort themselves"),
    "TORCH_NCCL_ENABLE_MONITORING": ("0", "the heartbeat monitor would kill a survivor whose watchdog is held by a dead peer"),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": ("0", "a CUDA error is reported to the coordinator and the process replaced, not rethrown in the watchdog"),
    "TORCH_NCCL_USE_COMM_NONBLOCKING": ("1", "non-blocking communicators can be aborted while a collective hangs"),
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": ("30", "bound (s) on a non-blocking communicator's init and abort"),
}
DETERMINISM_ENV: Dict[str, Tuple[str, str]] = {
    "NCCL_ALGO": ("Ring", "one reduction algorithm, so that sums are added in one order"),
    "NCCL_PROTO": ("Simple", "one protocol, so that chunking does not change the order"),
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", "deterministic cuBLAS (torch.use_deterministic_algorithms needs it)"),
}

from ..config import COMMS, DEVICES  # noqa: E402,F401  # the schema owns the choices (config.py imports no train code)


def nccl_environment(current: Mapping[str, str], deterministic: bool = True) -> Tuple[Dict[str, str], List[str]]:
    """What to set, and a line for each of the user's settings that disagrees (and is replaced)."""
    wanted = dict(NCCL_ENV)
    if deterministic:
        wanted.update(DETERMINISM_ENV)
    to_set: Dict[str, str] = {}
    conflicts: List[str] = []
    for name, (value, why) in wanted.items():
        have = current.get(name)
        if have is not None and have != value:
            conflicts.append(f"{name}={have} replaced by {value}: {why}")
        if have != value:
            to_set[name] = value
    return to_set, conflicts


def resolve_device(device: str, comm: str, cuda_available: bool, cluster_backend: str = "slurm") -> Tuple[str, str]:
    """(device type, collective backend) from the config's ``cluster.device`` and ``cluster.comm``.
    ``comm=auto`` is nccl on CUDA, except with ``cluster=local``, whose simulated nodes all live
    on one machine and would put NCCL ranks of two nodes on one GPU: gloo there."""
    dev = ("cuda" if cuda_available else "cpu") if device == "auto" else device
    if dev == "cuda" and not cuda_available:
        raise ValueError("cluster.device=cuda but torch sees no CUDA device here. HINT: run on a GPU node, or set cluster.device=auto (CPU where there is no GPU)")
    backend = ("nccl" if dev == "cuda" and cluster_backend != "local" else "gloo") if comm == "auto" else comm
    if backend == "nccl" and dev != "cuda":
        raise ValueError("cluster.comm=nccl needs cluster.device=cuda. HINT: use cluster.comm=gloo (or auto) on CPU")
    return dev, backend


def cuda_index(local_index: int, workers_per_node: int, visible: int, backend: str) -> int:
    """The GPU of the worker with this local index (LOCAL_RANK-style: local index i uses GPU
    i mod visible). NCCL refuses two ranks on one device: such a layout is an error."""
    if visible < 1:
        raise ValueError("no CUDA device is visible. HINT: check CUDA_VISIBLE_DEVICES and --gpus-per-node")
    if backend == "nccl" and workers_per_node > visible:
        raise ValueError(
            f"cluster.workers_per_node={workers_per_node} puts {workers_per_node} NCCL ranks on {visible} GPU(s): NCCL refuses two ranks "
            f"on one device. HINT: set cluster.workers_per_node={visible} (one rank per GPU; cluster.gpus_per_node={visible} on Slurm), "
            "or cluster.comm=gloo to share GPUs"
        )
    return local_index % visible


def poisons_context(exc: BaseException) -> bool:
    """A CUDA error after which this process's context cannot be trusted (illegal address, ECC,
    Xid-class faults, device-side asserts): the process must be replaced, never recovered."""
    text = f"{type(exc).__name__}: {exc}"
    markers = (
        "illegal memory access",
        "an illegal instruction",
        "misaligned address",
        "unspecified launch failure",
        "uncorrectable ECC error",
        "device-side assert",
        "Xid",
        "CUDA error: unknown error",
        "cudaErrorLaunchFailure",
        "AcceleratorError",
    )
    return any(m in text for m in markers)


def deterministic_cuda_settings() -> Optional[str]:
    """Turn on torch's deterministic algorithms for CUDA; returns what could not be set, or None."""
    import torch

    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return str(e)
    return None


def prepare(cluster: Any, local_index: int, environ: Any, log: Any) -> Tuple[Any, str]:
    """The I/O side, once per worker at start-up: pick the device and backend, set the NCCL and
    determinism environment (reporting a user's conflicting value), select the GPU and create
    its context now (a hot spare is then ready before it is needed)."""
    import torch

    dev, backend = resolve_device(cluster.device, cluster.comm, torch.cuda.is_available(), cluster.backend)
    if dev == "cpu":
        return torch.device("cpu"), backend
    to_set, conflicts = nccl_environment(environ) if backend == "nccl" else ({k: v for k, (v, _) in DETERMINISM_ENV.items() if k not in environ}, [])
    for line in conflicts:
        log.warning("environment: %s", line)
    environ.update(to_set)
    visible = cluster.gpus_per_node or torch.cuda.device_count()
    index = cuda_index(local_index, cluster.workers_per_node, min(visible, torch.cuda.device_count()), backend)
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    problem = deterministic_cuda_settings()
    if problem:
        log.warning("deterministic CUDA settings incomplete: %s", problem)
    torch.zeros(1, device=device).add_(1)  # the context and the caching allocator, now
    torch.cuda.synchronize(device)
    return device, backend
