"""The shipped text corpus (Python Language Reference text, PSF license; see data/SOURCE.md).

Loaded through importlib.resources, so it works from a source tree, an editable install
and a wheel alike, offline, with the same bytes everywhere.
"""

from __future__ import annotations

import functools
import importlib.resources

import torch

__all__ = ["CORPUS_RESOURCE", "VAL_FRACTION", "load_corpus", "corpus_splits"]

CORPUS_RESOURCE = "data/corpus.txt"
VAL_FRACTION = 0.1


@functools.lru_cache(maxsize=1)
def load_corpus() -> torch.Tensor:
    """The whole corpus as a 1-D uint8 tensor of bytes, read once per process.

    The tensor is shared by every caller: treat it as read-only.
    """
    data = importlib.resources.files("ckptless_hpc.tasks").joinpath(CORPUS_RESOURCE).read_bytes()
    if not data:
        raise ValueError(f"corpus resource {CORPUS_RESOURCE!r} is empty. HINT: reinstall ckptless_hpc; the wheel must include ckptless_hpc/tasks/data/*.")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def corpus_splits(val_fraction: float = VAL_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) views of the corpus: the first ``1 - val_fraction`` of the bytes, the rest."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1). HINT: the default is {VAL_FRACTION}.")
    data = load_corpus()
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]
