"""Process groups, one per generation, built directly on a prefixed store.

A group of generation g is never destroyed when it breaks: destroying a group stuck on a hung
peer blocks until the group's own timeout. It is abandoned instead (kept referenced until the
process exits) and generation g+1 forms a fresh group on the store prefix ``gen<g+1>``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def device_for(local_index: int) -> torch.device:
    """CUDA when present (one device per local worker), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_index % torch.cuda.device_count())
    return torch.device("cpu")


def form_group(store: Any, gen: int, rank: int, world: int, host: str, timeout_s: float, device: torch.device) -> Any:
    prefixed = dist.PrefixStore(f"gen{gen}", store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, world, opts)


def connect_store(host: str, port: int, timeout_s: float) -> Any:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
