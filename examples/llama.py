"""A Llama-style decoder written the way torchtitan writes its Llama 3: RMSNorm, SwiGLU,
grouped-query attention, a complex64 RoPE cache as a non-persistent buffer; the model zoo's
(tests/models/__init__.py), and the example of tensor and pipeline parallel (docs/sharding.md).

- ``LlamaTask``: a fused ``wqkv`` that its ``state_dict`` hooks present as ``wq``/``wk``/``wv``;
- ``LlamaTPTask``: ``wq``/``wk``/``wv`` apart and torchtitan's tensor-parallel plan;
- ``LlamaSPTask``: the same with sequence parallel (torchtitan's ``apply_tp`` whole)::

    python -m ckptless_hpc '~task' +task._target_=examples.llama.LlamaSPTask parallel=tp parallel.tp=2 cluster.nodes=2 cluster.workers_per_node=2
- ``LlamaPPTask``: pipeline stages cut torchtitan's way (its manual split);
- ``LlamaParallelTask``: both, the example a user runs. From the repository root (the workers
  import ``examples.*`` from there), tensor parallel in groups of 2 ranks, two replicas::

    python -m ckptless_hpc '~task' +task._target_=examples.llama.LlamaParallelTask parallel=tp parallel.tp=2 cluster.nodes=2 cluster.workers_per_node=2

  pipelines of 2 stages, two replicas, 1F1B over 4 micro-batches::

    python -m ckptless_hpc '~task' +task._target_=examples.llama.LlamaParallelTask parallel=pp parallel.pp=2 parallel.pp_schedule=1f1b train.grad_accum=4 cluster.nodes=2 cluster.workers_per_node=2

  FSDP2 inside the pipeline stages (pp x shard): two pipelines per replica, each stage sharded over both::

    python -m ckptless_hpc '~task' +task._target_=examples.llama.LlamaParallelTask parallel=pp parallel.pp=2 parallel.shard_size=2 train.grad_accum=2 cluster.nodes=2 cluster.workers_per_node=4

  all four dims (replicas x pp x shard x tp): two pipelines of 2 stages, each stage TP 2 and FSDP2 over the pipelines::

    python -m ckptless_hpc '~task' +task._target_=examples.llama.LlamaParallelTask parallel=pp parallel.pp=2 parallel.shard_size=2 parallel.tp=2 train.grad_accum=2 cluster.nodes=2 cluster.workers_per_node=8

  tensor parallel with three replicas, a killed rank refilled from another replica::

    python -m ckptless_hpc '~task' +task._target_=examples.llama.LlamaParallelTask parallel=tp parallel.tp=2 cluster.nodes=3 cluster.workers_per_node=2 fault=kill_worker fault.rank=3 fault.step=5
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ckptless_hpc.tasks.base import Task, derive_generator


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))  # complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh, as torchtitan's hooks redistribute)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


class FusedQKVAttention(nn.Module):
    """Grouped-query attention with one fused ``wqkv`` parameter, laid out
    ``(n_kv_heads, heads_per_kv + 2, head_dim, dim)``; ``state_dict()`` shows ``wq``/``wk``/``wv``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.rep = n_heads // n_kv_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.register_state_dict_post_hook(FusedQKVAttention._split_qkv_on_save)
        self.register_load_state_dict_pre_hook(FusedQKVAttention._merge_qkv_on_load)

    def _split(self, w: torch.Tensor) -> List[torch.Tensor]:
        dim = w.shape[-1]
        g = w.view(self.n_kv_heads, self.rep + 2, self.head_dim, dim)
        q = g[:, : self.rep].reshape(self.n_heads * self.head_dim, dim)
        k = g[:, self.rep].reshape(self.n_kv_heads * self.head_dim, dim)
        v = g[:, self.rep + 1].reshape(self.n_kv_heads * self.head_dim, dim)
        return [q.contiguous(), k.contiguous(), v.contiguous()]

    @staticmethod
    def _split_qkv_on_save(module: "FusedQKVAttention", state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        w = state_dict.pop(prefix + "wqkv.weight")
        for name, t in zip(("wq", "wk", "wv"), module._split(_full(w).detach())):
            state_dict[f"{prefix}{name}.weight"] = t

    @staticmethod
    def _merge_qkv_on_load(module: "FusedQKVAttention", state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "wq.weight" not in state_dict:
            return
        q, k, v = (state_dict.pop(f"{prefix}{n}.weight") for n in ("wq", "wk", "wv"))
        dim = q.shape[-1]
        q = q.view(module.n_kv_heads, module.rep, module.head_dim, dim)
        k = k.view(module.n_kv_heads, 1, module.head_dim, dim)
        v = v.view(module.n_kv_heads, 1, module.head_dim, dim)
        state_dict[prefix + "wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, self.n_kv_heads, self.rep + 2, self.head_dim)
        q = qkv[:, :, :, : self.rep].reshape(b, s, self.n_heads, self.head_dim)
        k, v = qkv[:, :, :, self.rep], qkv[:, :, :, self.rep + 1]
        q, k = apply_rotary_emb(q, k, freqs_cis)
        k = k.repeat_interleave(self.rep, dim=2)
        v = v.repeat_interleave(self.rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Attention(nn.Module):
    """Grouped-query attention with ``wq``/``wk``/``wv`` apart, as torchtitan writes it for tensor
    parallel: the heads are counted from the projections' output (``view(..., -1, head_dim)``),
    so a rank holding a column shard of them computes its own heads."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, fused_qkv: bool = True) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = FusedQKVAttention(dim, n_heads, n_kv_heads) if fused_qkv else Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 48, max_seq: int = 16, fused_qkv: bool = True
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden, fused_qkv) for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


class LlamaTask(Task):
    """Next-token prediction on synthetic sequences (a fixed pattern plus noise: learnable)."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 2, batch_size: int = 4, seq_len: int = 12, n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 48) -> None:
        self.vocab, self.dim, self.n_layers, self.batch_size, self.seq_len = vocab, dim, n_layers, batch_size, seq_len
        self.n_heads, self.n_kv_heads, self.hidden = n_heads, n_kv_heads, hidden

    def _llama(self, cls: Optional[type] = None, fused_qkv: bool = True) -> nn.Module:
        """The decoder of this task's sizes (``cls``: Llama or a subclass)."""
        return (cls or Llama)(self.vocab, self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.hidden, max_seq=self.seq_len + 4, fused_qkv=fused_qkv)

    def build_model(self) -> nn.Module:
        return self._llama()

    def shard_units(self, model: nn.Module) -> List[nn.Module]:
        return list(model.layers.values())

    def batch(self, step: int, rank: int, world: int, generator: torch.Generator) -> torch.Tensor:
        g = derive_generator(generator, step, rank, world)
        start = torch.randint(0, self.vocab, (self.batch_size, 1), generator=g)
        seq = (start + 3 * torch.arange(self.seq_len + 1)) % self.vocab
        noise = torch.randint(0, self.vocab, seq.shape, generator=g)
        return torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        batch = batch.to(device)
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def val_batch(self, index: int, rank: int, world: int, generator: torch.Generator) -> torch.Tensor:
        """Validation batch ``index`` (train.eval_every): drawn as the training batches are, from its own generator."""
        return self.batch(0, 0, 1, generator)

    def evaluate(self, model: nn.Module, batch: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The validation loss and next-token accuracy."""
        device = next(model.parameters()).device
        batch = batch.to(device)
        return next_token_metrics(model(batch[:, :-1]), batch[:, 1:])


def next_token_metrics(logits: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The loss and accuracy of ``logits`` predicting ``target`` (the next tokens)."""
    flat, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    return {"loss": F.cross_entropy(flat, target), "accuracy": (flat.argmax(-1) == target).float().mean()}


class LlamaTPTask(LlamaTask):
    """The same decoder with ``wq``/``wk``/``wv`` apart and torchtitan's tensor-parallel plan
    (``parallelize_llama``'s, less its sequence parallel): the attention's and the feed-forward's
    input projections column-wise, their output projections row-wise; the embeddings, the norms
    and the output head replicated."""

    def build_model(self) -> nn.Module:
        return self._llama(fused_qkv=False)

    def tp_plan(self, model: nn.Module) -> Dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: Dict[str, Any] = {}
        for name in model.layers:
            a, f = f"layers.{name}.attention", f"layers.{name}.feed_forward"
            plan.update({f"{a}.wq": ColwiseParallel(), f"{a}.wk": ColwiseParallel(), f"{a}.wv": ColwiseParallel(), f"{a}.wo": RowwiseParallel()})
            plan.update({f"{f}.w1": ColwiseParallel(), f"{f}.w3": ColwiseParallel(), f"{f}.w2": RowwiseParallel()})
        return plan


class LlamaPP(Llama):
    """The decoder whose forward skips the modules a pipeline stage does not hold (None), as
    torchtitan's Llama does: the first stage takes tokens, a later one the previous stage's
    hidden states; only the last stage has the norm and the output head."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs_cis = self.freqs_cis[: h.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


class LlamaSPTask(LlamaTPTask):
    """The same decoder with torchtitan's whole tensor-parallel plan, sequence parallel included
    (``parallelize_llama``'s ``apply_tp``): between the blocks the activations stay sharded along
    the sequence (``Shard(1)``), the norms run on each rank's part of it (``SequenceParallel``, their
    weights replicated), each block gathers its input before the column-wise projections
    (``PrepareModuleInput``) and its row-wise output projection scatters the sum back along the
    sequence; the embedding is row-wise (sharded along the vocabulary), the output head
    column-wise with its logits replicated (no loss parallel)."""

    def tp_plan(self, model: nn.Module) -> Dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

        plan: Dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        for name in model.layers:
            b = f"layers.{name}"
            plan.update(
                {
                    f"{b}.attention_norm": SequenceParallel(),
                    f"{b}.attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                    f"{b}.attention.wq": ColwiseParallel(),
                    f"{b}.attention.wk": ColwiseParallel(),
                    f"{b}.attention.wv": ColwiseParallel(),
                    f"{b}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                    f"{b}.ffn_norm": SequenceParallel(),
                    f"{b}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    f"{b}.feed_forward.w1": ColwiseParallel(),
                    f"{b}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    f"{b}.feed_forward.w3": ColwiseParallel(),
                }
            )
        return plan


class LlamaPPTask(LlamaTask):
    """The same decoder cut into pipeline stages the way torchtitan's manual split cuts its Llama
    (``pipeline_llama_manual_split``): stage s of n keeps the layers [s*L//n, (s+1)*L//n) and
    deletes the others from the model itself (the names stay the model's), the first stage keeps
    the embedding, the last the norm and the output head; the rest are set to None."""

    def build_model(self) -> nn.Module:
        return self._llama(LlamaPP)

    def pp_stage(self, model: nn.Module, stage: int, n_stages: int) -> nn.Module:
        names = list(model.layers)
        lo, hi = stage * len(names) // n_stages, (stage + 1) * len(names) // n_stages
        for name in names[:lo] + names[hi:]:
            del model.layers[name]
        if stage > 0:
            model.tok_embeddings = None
        if stage < n_stages - 1:
            model.norm = None
            model.output = None
        return model

    def pp_split(self, batch: torch.Tensor) -> tuple:
        """(the first stage's input, the last stage's target): the tokens and the next tokens."""
        return batch[:, :-1], batch[:, 1:]

    def pp_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """:meth:`loss` on the last stage's output: ``loss(model, batch) == pp_loss(model(x), y)``."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def pp_evaluate(self, output: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        """:meth:`evaluate` on the last stage's output (train.eval_every under parallel=pp):
        ``evaluate(model, batch) == pp_evaluate(model(x), y)``."""
        return next_token_metrics(output, target)


class LlamaParallelTask(LlamaPPTask):
    """The decoder with ``wq``/``wk``/``wv`` apart, torchtitan's tensor-parallel plan and its
    pipeline stages: one task for ``parallel=tp`` and ``parallel=pp`` (and any other mode)."""

    def build_model(self) -> nn.Module:
        return self._llama(LlamaPP, fused_qkv=False)

    tp_plan = LlamaTPTask.tp_plan
