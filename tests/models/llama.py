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
    LlamaTask,
    LlamaTPTask,
    RMSNorm,
    TransformerBlock,
    apply_rotary_emb,
    precompute_freqs_cis,
)
