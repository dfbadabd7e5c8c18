"""The zoo's Llama lives in examples/llama.py (a user runs it from there); the zoo's tasks are
the same classes (``models.llama.LlamaTask`` and the rest)."""

import torch
from torch import nn

from examples.llama import (  # noqa: F401
    Attention,
    FeedForward,
    FusedQKVAttention,
    Llama,
    LlamaParallelTask,
    LlamaPP,
    LlamaPPTask,
    LlamaSPTask,
    LlamaTask,
    LlamaTPTask,
    RMSNorm,
    TransformerBlock,
    apply_rotary_emb,
    next_token_metrics,
    precompute_freqs_cis,
)


class LlamaPPMetricsTask(LlamaPPTask):
    """LlamaPPTask whose loss (and, under parallel=pp, the last stage's pp_loss) also returns the
    step's next-token accuracy: the task's own metric of a step, carried through a pipeline."""

    def loss(self, model, batch):
        x, y = self.pp_split(batch.to(next(model.parameters()).device))
        return self.pp_loss(model(x), y)

    def pp_loss(self, output, target):
        metrics = next_token_metrics(output, target)
        return metrics["loss"], {"accuracy": metrics["accuracy"]}


class LlamaCountingTask(LlamaParallelTask):
    """LlamaParallelTask (wq/wk/wv apart, a tensor-parallel plan, pipeline stages) whose blocks
    also write buffers in place at each training forward, as BatchNorm's running statistics are
    written: an int64 count of forwards and a bool flag per feature of the inputs it has seen past
    3.0 (data-dependent, so the replicas' differ and each step's must be replica 0's). Under
    ``parallel=tp`` every rank of a TP group writes the same values; under ``parallel=pp`` each
    stage writes its own blocks'."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        for block in model.layers.values():
            block.register_buffer("forwards", torch.zeros((), dtype=torch.int64))
            block.register_buffer("saw_large", torch.zeros(self.dim, dtype=torch.bool))
            block.register_forward_pre_hook(_count)
        return model


def _count(block, args):
    if block.training:
        with torch.no_grad():
            block.forwards += 1
            block.saw_large |= (args[0].detach().abs() > 3.0).reshape(-1, args[0].shape[-1]).any(0)
