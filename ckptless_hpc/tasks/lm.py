"""A small decoder-only byte-level transformer language model on the shipped text corpus."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ckptless_hpc.tasks.base import Task, format_count, check_int, derive_generator
from ckptless_hpc.tasks.corpus import corpus_splits

__all__ = ["LMTask", "ByteTransformer"]

VOCAB_SIZE = 256  # byte-level tokens
MLP_RATIO = 4


class _Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, MLP_RATIO * d_model)
        self.fc2 = nn.Linear(MLP_RATIO * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, t, head_dim]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ByteTransformer(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LN, (tied) output head."""

    def __init__(
        self,
        d_model: int,
        n_layers: int,
        n_heads: int,
        seq_len: int,
        dropout: float,
        tie_embeddings: bool,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = None if tie_embeddings else nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue  # LayerNorm weights keep their ones
            std = 0.02
            if name.endswith(("proj.weight", "fc2.weight")):
                std /= math.sqrt(2 * n_layers)
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [b, t, 256] for byte ids ``idx`` [b, t] (t <= seq_len)."""
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"input length {t} exceeds task.seq_len={self.seq_len}. HINT: raise task.seq_len or feed shorter windows.")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x) if self.head is not None else F.linear(x, self.tok.weight)


class LMTask(Task):
    """Next-byte prediction with a decoder-only transformer on the Python Language Reference text.

    ``batch_size`` is the per-rank micro-batch (windows of ``seq_len + 1`` bytes). Batches of
    (step, rank, world) are random windows of the training split (first 90 % of the corpus)
    drawn with the generator passed to :meth:`batch`.

    Sizes (parameter counts exact, ``tie_embeddings=True``; ~ 12 * n_layers * d_model**2).
    Step = batch + forward + backward + AdamW, batch_size=8, measured with
    ``torch.set_num_threads(1)`` on the project's 2-core CPU dev box:

    - default  d_model=128, n_layers=2,  n_heads=4,  seq_len=64:  437,760 params, ~20 ms
    - ~10 M    d_model=384, n_layers=6,  n_heads=6,  seq_len=256: 10,844,160 params, ~1.3 s
    - ~100 M   d_model=768, n_layers=14, n_heads=12, seq_len=256: 99,624,960 params, ~12.5 s
      (use a GPU)

    ``seq_len`` adds ``seq_len * d_model`` parameters (learned positions); untied embeddings
    add ``256 * d_model``. The default reaches loss ~3.2 (from ~5.4 at init) within 50
    steps at lr 3e-3.
    """

    def __init__(
        self,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
        batch_size: int = 8,
        dropout: float = 0.0,
        vocab: str = "byte",
        tie_embeddings: bool = True,
    ) -> None:
        self.d_model = check_int("d_model", d_model, hint="e.g. 128 (default), 384 (~10M), 768 (~100M).")
        self.n_layers = check_int("n_layers", n_layers, hint="e.g. 2 (default), 6 (~10M), 14 (~100M).")
        self.n_heads = check_int("n_heads", n_heads, hint="a divisor of task.d_model, e.g. 4.")
        if self.d_model % self.n_heads:
            raise ValueError(f"task.n_heads={n_heads} must divide task.d_model={d_model}. HINT: pick n_heads so that d_model / n_heads is an integer head size (e.g. 64).")
        self.seq_len = check_int("seq_len", seq_len, hint="context length in bytes, e.g. 64.")
        self.batch_size = check_int("batch_size", batch_size, hint="per-rank micro-batch size.")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"task.dropout={dropout!r} must be a float in [0, 1). HINT: 0.0 disables dropout.")
        self.dropout = float(dropout)
        if vocab != "byte":
            raise ValueError(f"task.vocab={vocab!r} is not supported. HINT: only 'byte' (256 tokens) exists.")
        self.vocab = vocab
        self.tie_embeddings = bool(tie_embeddings)
        self._train, self._val = corpus_splits()
        shortest = min(len(self._train), len(self._val))
        if self.seq_len + 1 > shortest:
            raise ValueError(f"task.seq_len={seq_len} is too long for the corpus split of {shortest} bytes. HINT: use task.seq_len <= {shortest - 1}.")
        self._offsets = torch.arange(self.seq_len + 1)

    def build_model(self) -> nn.Module:
        return ByteTransformer(
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.seq_len,
            self.dropout,
            self.tie_embeddings,
        )

    def batch(
        self,
        step: int,
        rank: int,
        world: int,
        generator: torch.Generator,
        *,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [batch_size, seq_len]; targets are inputs shifted by one.

        ``split="val"`` draws the windows from the validation split instead.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} must be 'train' or 'val'. HINT: the default is 'train'.")
        data = self._train if split == "train" else self._val
        g = derive_generator(generator, step, rank, world)
        starts = torch.randint(0, len(data) - self.seq_len, (self.batch_size,), generator=g)
        windows = data[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def shard_units(self, model: nn.Module) -> list:
        """parallel=fsdp|hsdp: each transformer block is an FSDP unit; the embeddings stay with
        the root, whose forward uses the token embedding's weight again as the tied output head."""
        return list(model.blocks)

    def tp_plan(self, model: nn.Module) -> dict:
        """parallel=tp: each block's MLP split Megatron's way (``fc1`` column-wise, ``fc2``
        row-wise: one all-reduce per block in forward and in backward); the attention, whose
        fused ``qkv`` is laid out q|k|v over all heads, the embeddings and the norms stay whole."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict = {}
        for i in range(len(model.blocks)):
            plan.update({f"blocks.{i}.fc1": ColwiseParallel(), f"blocks.{i}.fc2": RowwiseParallel()})
        return plan

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        device = next(model.parameters()).device
        logits = model(x.to(device))
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.to(device).reshape(-1))

    def num_parameters(self) -> int:
        """Parameter count of :meth:`build_model`, computed without building it."""
        d, r = self.d_model, MLP_RATIO
        per_block = (4 + 2 * r) * d * d + (9 + r) * d  # qkv, proj, fc1, fc2 (+ biases), 2 LNs
        total = VOCAB_SIZE * d + self.seq_len * d + self.n_layers * per_block + 2 * d
        return total + (0 if self.tie_embeddings else VOCAB_SIZE * d)

    def describe(self) -> str:
        return (
            f"LMTask(d_model={self.d_model}, n_layers={self.n_layers}, n_heads={self.n_heads}, "
            f"seq_len={self.seq_len}, batch_size={self.batch_size}, vocab={self.vocab}): "
            f"{format_count(self.num_parameters())} parameters"
        )
