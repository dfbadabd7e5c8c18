"""The zoo's Llama lives in examples/llama.py (a user runs it from there); the zoo's tasks are
the same classes (``models.llama.LlamaTask`` and the rest)."""

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
