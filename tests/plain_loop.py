"""The reference training as a plain PyTorch loop in one process: now public, as
:mod:`ckptless_hpc.reference` (``python -m ckptless_hpc.reference ... --compare RUN_DIR``). This
module keeps the names the tests import (``plain_loop.train``, ``plain_loop.max_differences``)."""

from __future__ import annotations

import torch

from ckptless_hpc.reference import *  # noqa: F401,F403
from ckptless_hpc.reference import differences, max_differences, train, warmup_cosine  # noqa: F401

AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
