"""What the two baseline workers (plain DDP, TorchFT) share: their event file and the model they build.

Kept apart from ``bench.common`` (the harness side): a worker imports only this and torch.
"""

from __future__ import annotations

import json
import time
from typing import Any, Tuple

import torch


class Events:
    """Append-only JSONL events, one flushed line each (time is ``time.time()``)."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", encoding="utf-8")

    def emit(self, ev: str, **kw: Any) -> None:
        kw.update(ev=ev, t=time.time())
        self._f.write(json.dumps(kw) + "\n")
        self._f.flush()


def build_lm(task_json: str, seed: int, device: str = "cpu") -> Tuple[Any, torch.nn.Module, torch.optim.Optimizer, Any]:
    """The LM task, model and AdamW exactly as a ckptless_hpc worker builds them: (task, model, optimizer, optim config)."""
    from ckptless_hpc.config import OptimConfig
    from ckptless_hpc.tasks.lm import LMTask

    torch.set_num_threads(1)
    task = LMTask(**json.loads(task_json))
    optim_cfg = OptimConfig()
    torch.manual_seed(seed)
    model = task.build_model().to(device)
    return task, model, task.build_optimizer(model, optim_cfg), optim_cfg
