"""A language model trained from a memory-mapped token file: the way to wrap a map-style
dataset (docs/tasks.md, "Data").

Make a token file (here: the byte-level corpus shipped with ckptless_hpc, one uint8 token per
byte; a real pipeline writes its tokenizer's ids as uint16/uint32 the same way), then train
from it with 2 DataLoader worker processes per rank:

    python -m examples.token_file_lm /tmp/tokens.bin
    python -m ckptless_hpc 'hydra.searchpath=[file://examples/conf]' task=token_file_lm \\
        task.path=/tmp/tokens.bin train.data_workers=2 fault=kill_worker fault.rank=1 fault.step=20

``TokenFile`` is an ordinary map-style ``Dataset``: item ``i`` is the window of ``seq_len + 1``
tokens starting at ``i * seq_len``. The task returns it from ``dataset()``; the framework maps
(step, micro-batch, rank) to item indices through a per-epoch permutation, so a replacement
starts at the committed step without reading the file up to there. The file is opened lazily in
each process that reads it (each DataLoader worker maps it itself).
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from ckptless_hpc.tasks.base import check_int
from ckptless_hpc.tasks.corpus import corpus_splits
from ckptless_hpc.tasks.lm import LMTask

__all__ = ["TokenFile", "TokenFileLM", "write_tokens"]


class TokenFile(Dataset):
    def __init__(self, path: str, seq_len: int, dtype: str = "uint8") -> None:
        self.path, self.seq_len, self.dtype = path, seq_len, np.dtype(dtype)
        self._tokens: Optional[np.memmap] = None
        n = len(self._map())
        if n < seq_len + 1:
            raise ValueError(f"task.path={path!r} holds {n} tokens, fewer than task.seq_len + 1 = {seq_len + 1}. HINT: a longer file or a shorter seq_len")
        self._len = (n - 1) // seq_len

    def _map(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self) -> dict:  # a worker process maps the file itself
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(np.array(self._map()[start : start + self.seq_len + 1], dtype=np.int64))


class TokenFileLM(LMTask):
    """The byte-level transformer of the ``lm`` task, fed from a token file instead of the corpus."""

    def __init__(self, path: str, token_dtype: str = "uint8", **lm: Any) -> None:
        super().__init__(**lm)
        self.path, self.token_dtype = path, token_dtype
        check_int("seq_len", self.seq_len, hint="context length in tokens")

    def dataset(self) -> Dataset:
        return TokenFile(self.path, self.seq_len, self.token_dtype)

    def collate(self, windows: List[torch.Tensor]):
        w = torch.stack(windows)
        return w[:, :-1], w[:, 1:]


def write_tokens(path: str) -> int:
    """Write the shipped corpus's training split as a uint8 token file; returns its length."""
    train, _ = corpus_splits()
    np.asarray(train.numpy(), dtype=np.uint8).tofile(path)
    return len(train)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m examples.token_file_lm OUT_PATH")
    print(f"wrote {write_tokens(sys.argv[1])} tokens to {sys.argv[1]}")
