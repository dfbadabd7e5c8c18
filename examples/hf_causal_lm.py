"""A Hugging Face ``transformers`` causal LM as a ckptless_hpc task: random weights, no download.

The model is built from a small config (``AutoConfig.for_model``), so nothing is fetched from
a hub; it learns next-byte prediction on the text corpus shipped with ckptless_hpc (256 byte
tokens, so no tokenizer either). Any causal-LM architecture of ``transformers`` works the
same way: ``task.model_type=llama`` builds a small Llama instead of GPT-2.

Install and run (from the repository root, so that the worker processes can import
``examples.hf_causal_lm``; elsewhere, put the repository on PYTHONPATH):

    pip install -e '.[examples]'            # transformers
    python -m ckptless_hpc 'hydra.searchpath=[file://examples/conf]' task=hf_causal_lm \\
        train.steps=60 fault=kill_worker fault.rank=1 fault.step=20

Options are constructor arguments, set on the command line: ``task.n_layer=4 task.n_embd=128
task.dropout=0.0``, and any other config field of the architecture through
``task.config='{rotary_pct:0.5}'`` (the task config, examples/conf/task/hf_causal_lm.yaml, has
every key). Without the config group, name the class and add its arguments (``~task`` drops the
default task's keys, ``+`` adds keys; ``task._target_=...`` alone would pass the ``lm`` task's
arguments to this class, and ``dry_run=true`` says so):

    python -m ckptless_hpc '~task' +task._target_=examples.hf_causal_lm.HFCausalLMTask \\
        +task.n_layer=4 train.steps=60

Determinism (what makes a run with a killed worker end bitwise equal to a fault-free one):
- the model is built under the seed the framework sets (random init, same on every worker);
- a batch is a pure function of (step, rank, world) and the generator the framework hands in;
- dropout draws from torch's global RNG, which the framework re-seeds from (seed, step, rank)
  before every step, so dropout masks are reproducible too.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ckptless_hpc.tasks.base import Task, check_int, derive_generator
from ckptless_hpc.tasks.corpus import corpus_splits

__all__ = ["HFCausalLMTask"]

VOCAB_SIZE = 256  # byte-level: every byte is a token


class HFCausalLMTask(Task):
    """A ``transformers`` causal LM (GPT-2 by default) with random weights, trained on bytes.

    Args:
        model_type: any ``transformers`` model type with a causal-LM head ("gpt2", "llama", ...).
        n_layer, n_embd, n_head: size of the model (mapped to each architecture's own names).
        seq_len: tokens per sample; batch_size: samples per rank and step.
        dropout: dropout probability (GPT-2's resid/embd/attn dropout).
        config: further fields of the architecture's config, e.g. ``{"tie_word_embeddings": False}``.
    """

    def __init__(
        self,
        model_type: str = "gpt2",
        n_layer: int = 2,
        n_embd: int = 64,
        n_head: int = 4,
        seq_len: int = 64,
        batch_size: int = 8,
        dropout: float = 0.1,
        config: Optional[Dict[str, Any]] = None,
    ) -> None:
        try:
            import transformers  # noqa: F401 - fail at construction with a clear message
        except ImportError:
            raise ImportError(
                "examples.hf_causal_lm needs Hugging Face transformers. HINT: pip install 'ckptless_hpc[examples]' "
                "(or pip install transformers)"
            ) from None
        hint = "see the docstring of examples.hf_causal_lm.HFCausalLMTask"
        self.model_type = str(model_type)
        self.n_layer = check_int("n_layer", n_layer, hint=hint)
        self.n_embd = check_int("n_embd", n_embd, hint=hint)
        self.n_head = check_int("n_head", n_head, hint=hint)
        if self.n_embd % self.n_head:
            raise ValueError(f"task.n_embd={n_embd} must be a multiple of task.n_head={n_head}. HINT: e.g. n_embd=64 with n_head=4")
        self.seq_len = check_int("seq_len", seq_len, minimum=2, hint=hint)
        self.batch_size = check_int("batch_size", batch_size, hint=hint)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"task.dropout={dropout!r} must be in [0, 1). HINT: 0.0 turns dropout off")
        self.dropout = float(dropout)
        self.extra = dict(config or {})
        self._train, _ = corpus_splits()
        self._offsets = torch.arange(self.seq_len)

    # ---------------------------------------------------------------- the model
    def hf_config(self) -> Any:
        """The architecture's config: small, random-init, byte vocabulary (no download)."""
        from transformers import AutoConfig

        sizes = _SIZE_NAMES.get(self.model_type, _SIZE_NAMES["llama"])
        kwargs: Dict[str, Any] = {
            "vocab_size": VOCAB_SIZE,
            sizes["layers"]: self.n_layer,
            sizes["width"]: self.n_embd,
            sizes["heads"]: self.n_head,
            sizes["positions"]: self.seq_len,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }
        if self.model_type == "gpt2":
            kwargs.update(resid_pdrop=self.dropout, embd_pdrop=self.dropout, attn_pdrop=self.dropout)
        else:
            kwargs.update(intermediate_size=4 * self.n_embd, attention_dropout=self.dropout)
        kwargs.update(self.extra)
        try:
            return AutoConfig.for_model(self.model_type, **kwargs)
        except ValueError as e:
            raise ValueError(f"task.model_type={self.model_type!r}: {e}. HINT: use a transformers model type such as gpt2 or llama") from None

    def build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # keep the worker logs about training, not config notes
        # Random weights from the framework's seed: the same model on every worker, no download.
        return AutoModelForCausalLM.from_config(self.hf_config())

    # ---------------------------------------------------------------- data and loss
    def batch(self, step: int, rank: int, world: int, generator: torch.Generator) -> torch.Tensor:
        """Token ids [batch_size, seq_len]: random windows of the corpus, a pure function
        of (step, rank, world) and ``generator`` (never of how many steps this process ran)."""
        g = derive_generator(generator, step, rank, world)
        starts = torch.randint(0, len(self._train) - self.seq_len, (self.batch_size,), generator=g)
        return self._train[starts[:, None] + self._offsets].long()

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        ids = batch.to(next(model.parameters()).device)
        # transformers shifts the labels itself: the loss is next-token cross-entropy
        return model(input_ids=ids, labels=ids).loss

    def describe(self) -> str:
        return f"HFCausalLMTask({self.model_type}, n_layer={self.n_layer}, n_embd={self.n_embd}, n_head={self.n_head}): {super().describe()}"


#: What each architecture calls depth, width, heads and context length.
_SIZE_NAMES: Dict[str, Dict[str, str]] = {
    "gpt2": {"layers": "n_layer", "width": "n_embd", "heads": "n_head", "positions": "n_positions"},
    "llama": {"layers": "num_hidden_layers", "width": "hidden_size", "heads": "num_attention_heads", "positions": "max_position_embeddings"},
}


def _smoke(steps: int = 3) -> Tuple[float, float]:
    """Train a few steps in this process (no ckptless_hpc job): (first loss, last loss)."""
    task = HFCausalLMTask(dropout=0.0)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        loss = task.loss(model, task.batch(step, 0, 1, torch.Generator().manual_seed(step)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


if __name__ == "__main__":
    print("first/last loss of a 3-step smoke run:", _smoke())
