"""Training tasks: the documented :class:`Task` interface and the built-in tasks.

Select one with Hydra (``task=lm`` / ``task=mlp``); a user task subclasses :class:`Task`
and is named by its config's ``_target_``.
"""

from ckptless_hpc.tasks.base import Task, derive_generator, lr_at, mix_seed, num_parameters
from ckptless_hpc.tasks.corpus import corpus_splits, load_corpus
from ckptless_hpc.tasks.lm import LMTask
from ckptless_hpc.tasks.mlp import MLPTask

__all__ = [
    "Task",
    "MLPTask",
    "LMTask",
    "lr_at",
    "mix_seed",
    "derive_generator",
    "num_parameters",
    "load_corpus",
    "corpus_splits",
]
