"""EMA weights, a metric of your own and an evaluation, in one task.

Run it (from the repository root, so that the worker processes can import ``examples.*``):

    python -m ckptless_hpc 'hydra.searchpath=[file://examples/conf]' task=ema \\
        train.steps=40 train.eval_every=10 fault=kill_worker fault.rank=1 fault.step=15

- ``on_step_end(model, optimizer, step)`` runs on every rank after each committed optimizer
  step and moves the EMA weights towards the model's. The EMA weights are returned by
  ``state_dict()``: so they are carried to a replacement with the rest of the state, hashed
  (the run's final sha256 covers them) and saved in an emergency copy. State kept anywhere
  else (an attribute ``state_dict()`` does not return) would be lost at the first recovery.
- ``loss()`` returns ``(loss, {"accuracy": ...})``: the accuracy is averaged over the
  micro-batches and ranks like the loss, and logged as ``train/accuracy``.
- ``val_batch(index, ...)`` and ``evaluate(model, batch)``: with ``train.eval_every=N``, every N
  steps and at the end, ``train.eval_batches`` batches are evaluated (spread over the ranks,
  under ``torch.no_grad()`` and ``model.eval()``), for the model and for its EMA weights.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ckptless_hpc.tasks.mlp import MLPTask

__all__ = ["EMATask"]


class EMATask(MLPTask):
    """The MLP classifier of ``ckptless_hpc.tasks.mlp`` with EMA weights (``decay`` per step)."""

    def __init__(self, decay: float = 0.9, **kw: Any) -> None:
        super().__init__(**kw)
        if not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"task.decay={decay!r} must be in [0, 1). HINT: 0.999 averages over about 1000 steps")
        self.decay = float(decay)
        self.ema: Dict[str, torch.Tensor] = {}

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        if not any(p.is_meta for p in model.parameters()):  # describe() counts parameters on the meta device
            self.ema = {n: p.detach().clone() for n, p in model.named_parameters()}
        return model

    def on_step_end(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        for n, p in model.named_parameters():
            if self.ema[n].device != p.device:  # built before the model moved to its device
                self.ema[n] = self.ema[n].to(p.device)
            self.ema[n].lerp_(p.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict:
        return {f"ema.{n}": t for n, t in self.ema.items()}

    def load_state_dict(self, state: dict) -> None:
        for n, t in self.ema.items():
            t.copy_(state[f"ema.{n}"])

    def loss(self, model: torch.nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, y = _to(model, batch)
        logits = model(x)
        return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(dim=1) == y).float().mean()}

    def val_batch(self, index: int, rank: int, world: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``index``: a function of the index's generator alone (not of the rank)."""
        x = torch.randn(self.batch_size, self.input_dim, generator=generator)
        return x, (x @ self._teacher).argmax(dim=1)

    def evaluate(self, model: torch.nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> Dict[str, torch.Tensor]:
        x, y = _to(model, batch)
        out = {}
        for prefix, logits in (("", model(x)), ("ema_", functional_call(model, self.ema, (x,)))):
            out[prefix + "loss"] = F.cross_entropy(logits, y)
            out[prefix + "accuracy"] = (logits.argmax(dim=1) == y).float().mean()
        return out


def _to(model: torch.nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    return batch[0].to(device), batch[1].to(device)
