"""Two views of a model's state, each with one owner.

- **The job's view** (snapshots, rollback, shard copies, fetch, transfer, resume): the model's
  tensors themselves, by identity, :func:`model_tensors`: every parameter and every buffer once
  (a tie is one tensor under its first name), non-persistent buffers included, whatever their
  dtype. It never runs a user's ``state_dict`` hook: a hook may present copies that share no
  storage with the parameter (torchtitan's fused ``wqkv`` shown as ``wq``/``wk``/``wv``), or run a
  collective (a DTensor redistributed), which one rank alone would wait on forever.
- **The user's view** (``final/model.pt``, ``ckptless-hpc export``): the model's own
  ``state_dict()``, hooks included: tied aliases equal to their tensor, no non-persistent buffer.
  :class:`UserView` is how one model maps it to the job's view, recorded once when the model is
  built (plain tensors, before any sharding: no hook communicates then); :func:`present` makes
  the user's view from a full job's view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

Named = List[Tuple[str, torch.Tensor]]


def model_tensors(model: torch.nn.Module) -> Named:
    """The model's parameters, then its buffers, each tensor once (a tie under its first name)."""
    seen: set = set()
    out: Named = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def parameter_names(model: torch.nn.Module) -> List[str]:
    return [n for n, _ in model.named_parameters()]


@dataclass(frozen=True)
class UserView:
    """How a model's ``state_dict()`` maps to its tensors: ``keys`` (state-dict key -> the name
    of the tensor it is, as :func:`model_tensors` names it; a tied alias maps to its tensor's
    first name) and ``renamed`` (keys whose value is not a model tensor: a hook made them, so
    only the model itself can present them: :func:`present`). It travels in a state's metadata
    (``meta["user_view"]``) as what differs from the tensors' names, a few names for most models."""

    keys: Dict[str, str]
    renamed: Tuple[str, ...] = ()

    @classmethod
    def of(cls, model: torch.nn.Module) -> "UserView":
        name_of = {id(t): n for n, t in model_tensors(model)}
        keys: Dict[str, str] = {}
        renamed: List[str] = []
        for k, v in model.state_dict(keep_vars=True).items():
            if isinstance(v, torch.Tensor) and id(v) in name_of:
                keys[k] = name_of[id(v)]
            else:
                renamed.append(k)
        return cls(keys, tuple(renamed))

    def to_json(self, names: Sequence[str]) -> Dict[str, Any]:
        """Compact: the keys that are not their tensor's name (ties), the tensors no key shows
        (non-persistent buffers), the keys a hook made; ``names``: the model's tensor names."""
        shown = {n for k, n in self.keys.items() if k == n}
        return {"aliases": {k: n for k, n in self.keys.items() if k != n}, "hidden": [n for n in names if n not in shown], "renamed": list(self.renamed)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], names: Sequence[str]) -> "UserView":
        hidden = set(d.get("hidden", ()))
        keys = {n: n for n in names if n not in hidden}
        keys.update(d.get("aliases", {}))
        return cls(keys, tuple(d.get("renamed", ())))


def load_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], what: str = "the state", only: Optional[AbstractSet[str]] = None) -> None:
    """Copy ``tensors`` (name as :func:`model_tensors` names it -> whole tensor) into the model's
    own tensors, in place, without running a hook; every tensor of the model (``only``: these of
    them) must get one of the same shape and dtype, checked before anything is written (a refused
    load changes nothing)."""
    own = {n: t for n, t in model_tensors(model) if only is None or n in only}
    missing, unknown = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unknown:
        raise ValueError(f"{what} does not match the model: missing {missing[:5]}, unexpected {unknown[:5]}. HINT: it must come from the same task's build_model()")
    for n, dst in own.items():
        src = tensors[n]
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ValueError(f"{what}: {n} is {tuple(src.shape)} {src.dtype}, the model's tensor {tuple(dst.shape)} {dst.dtype}. HINT: the same task and precision")
    with torch.no_grad():
        for n, dst in own.items():
            dst.copy_(tensors[n])


def present(tensors: Mapping[str, torch.Tensor], view: UserView, build_model: Optional[Callable[[], torch.nn.Module]] = None) -> Dict[str, torch.Tensor]:
    """The user's view (the model's ``state_dict()``) of a full job's view ``tensors``. With no
    key made by a hook it is a renaming (no model needed); otherwise a fresh, unsharded model from
    ``build_model`` takes the tensors and presents them through its own hooks."""
    if not view.renamed:
        missing = sorted(k for k, n in view.keys.items() if n not in tensors)
        if missing:
            raise KeyError(f"the state lacks {len(missing)} tensor(s) of the model ({', '.join(missing[:4])})")
        return {k: tensors[n] for k, n in view.keys.items()}
    if build_model is None:
        raise ValueError(
            f"the model's state_dict() makes keys of its own ({', '.join(view.renamed[:4])}: a state_dict hook): only the model can present them. "
            "HINT: export from the run directory (its config names the task), or give the task"
        )
    model = build_model()
    load_tensors(model, tensors, "the saved state")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
