"""A GPT-2-style LM written the way Hugging Face writes its GPT-2 (tests/models/__init__.py):
``lm_head.weight`` is ``transformer.wte.weight`` (tied; not the largest tensor), dropout, and the
causal mask as a bool non-persistent buffer."""

from __future__ import annotations

from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn

from ckptless_hpc.tasks.base import Task, derive_generator


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int, max_seq: int, p: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.register_buffer("bias", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.n_head) ** 0.5
        att = att.masked_fill(~self.bias[:s, :s], float("-inf"))
        y = self.drop(att.softmax(-1)) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, max_seq: int, p: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_head, max_seq, p)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int, n_head: int, max_seq: int, p: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_seq, d)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList([Block(d, n_head, max_seq, p) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)


class GPT(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, n_layer: int = 2, n_head: int = 2, max_seq: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.transformer = Transformer(vocab, d, n_layer, n_head, max_seq, p)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT2LMHeadModel.tie_weights()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


class GPTTask(Task):
    """GPT-2 as Hugging Face writes it. Three blocks: under ZeRO on two ranks the tied embedding
    is then owned by rank 1 (the condition of the stale-alias failure). SGD with momentum, not
    AdamW: the key part of ``c_attn.bias`` has an analytically zero gradient (softmax is blind to
    a shift along a row), so its computed gradient is rounding noise, and Adam turns noise into
    steps of +-lr whose sign any other summation order flips: equality with a plain loop could
    not hold for it under any framework."""

    def __init__(self, vocab: int = 40, d: int = 16, n_layer: int = 3, batch_size: int = 4, seq_len: int = 12) -> None:
        self.vocab, self.d, self.n_layer, self.batch_size, self.seq_len = vocab, d, n_layer, batch_size, seq_len

    def build_model(self) -> nn.Module:
        return GPT(self.vocab, self.d, self.n_layer, max_seq=self.seq_len + 4)

    def build_optimizer(self, model: nn.Module, optim: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=float(optim.lr), momentum=0.9, weight_decay=float(optim.weight_decay))

    def shard_units(self, model: nn.Module) -> List[nn.Module]:
        return list(model.transformer.h)  # the tied embedding and head stay with the root

    def batch(self, step: int, rank: int, world: int, generator: torch.Generator) -> torch.Tensor:
        g = derive_generator(generator, step, rank, world)
        start = torch.randint(0, self.vocab, (self.batch_size, 1), generator=g)
        return (start + 5 * torch.arange(self.seq_len + 1)) % self.vocab

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        batch = batch.to(device)
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
