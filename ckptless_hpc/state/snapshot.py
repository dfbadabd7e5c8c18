"""The training state as one canonical, ordered list of named tensors plus JSON metadata.

Model parameters and buffers, optimizer state and whatever the task registers are
transferred; data position, RNG and LR schedule are derived from (seed, step, rank) and never
are. The same canonical order gives ``state_sha256``, the test oracle's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

import torch

from .views import load_tensors, model_tensors

Entries = List[Tuple[str, torch.Tensor]]
VIEW = "tensors"  # meta["view"]: model.<name> entries are the model's tensors (state/views.py); absent: state_dict() keys (read still)


class Piece(NamedTuple):
    """One named piece of the training state and who owns its bytes: ``owner`` None means every
    rank holds the same bytes (replicated); a rank number means only that rank does (sharded)."""

    key: str
    tensor: torch.Tensor
    owner: Optional[int] = None


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (CPU, contiguous), without a copy where possible."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def collect_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Any,
    step: int,
    extra: Optional[Dict[str, Any]] = None,
    model_keys: Optional[Set[str]] = None,
) -> Tuple[Entries, Dict[str, Any]]:
    """Views of the live state (no copies) in canonical order, plus metadata (``extra`` holds the
    engine's JSON-able state: scheduler, grad scaler, counters). The model's part is its tensors
    themselves (state/views.py: no ``state_dict`` hook runs); ``model_keys``: only these tensors
    (a rank's shard of the model)."""
    entries: Entries = [(f"model.{k}", v.detach()) for k, v in model_tensors(model) if model_keys is None or k in model_keys]
    sd = optimizer.state_dict()
    names = param_names(model, optimizer)  # the optimizer's state by parameter: optim.<name>.<key>
    scalars: Dict[str, Any] = {}
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            v = sd["state"][i][k]
            if torch.is_tensor(v):
                entries.append((f"optim.{names[i]}.{k}", v))
            else:
                scalars[f"{names[i]}.{k}"] = v
    task_scalars: Dict[str, Any] = {}
    for k, v in sorted((task.state_dict() or {}).items()):
        if torch.is_tensor(v):
            entries.append((f"task.{k}", v))
        else:
            task_scalars[k] = v
    meta = {"step": step, "view": VIEW, "param_groups": sd["param_groups"], "param_names": names, "optim_scalars": scalars, "task_scalars": task_scalars, **(extra or {})}
    return entries, plain_meta(meta)


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> List[str]:
    """The name of each parameter the optimizer steps, in its order (its state_dict's indices)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer steps a tensor that is not a parameter of the model. HINT: build the optimizer over model.parameters() (or groups of them)")
            out.append(name_of[id(p)])
    return out


def plain_meta(meta: Dict[str, Any]) -> Dict[str, Any]:
    """The metadata as plain JSON values (what the wire and the fingerprint carry), or a clear error."""
    try:
        return json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"the training state's metadata cannot be carried to a replacement ({e}). HINT: param groups, a scheduler's "
            "and a task's state_dict() may hold only numbers, strings, lists and dicts besides tensors"
        ) from None


def apply_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, task: Any, entries: Entries, meta: Dict[str, Any], model_keys: Optional[Set[str]] = None) -> None:
    """Load a received state into a built model/optimizer/task (the inverse of collect_state;
    ``model_keys``: the shard of the model's state dict it holds, exactly)."""
    apply_model_state(model, task, [e for e in entries if not e[0].startswith("optim.")], meta, model_keys)
    apply_optimizer_state(optimizer, [e for e in entries if e[0].startswith("optim.")], meta, model)


def apply_model_state(model: torch.nn.Module, task: Any, entries: Entries, meta: Dict[str, Any], model_keys: Optional[Set[str]] = None) -> None:
    """The model's and the task's part of a state (what a step's forward and backward need)."""
    model_sd: Dict[str, torch.Tensor] = {}
    task_sd: Dict[str, Any] = dict(meta.get("task_scalars", {}))
    for name, t in entries:
        kind, _, rest = name.partition(".")
        if kind == "model":
            model_sd[rest] = t
        elif kind == "task":
            task_sd[rest] = t
        else:
            raise ValueError(f"state entry {name!r} has an unknown section {kind!r} (the model's part holds model.* and task.*)")
    if meta.get("view") == VIEW:
        load_tensors(model, model_sd, "the state" if model_keys is None else "the shard's state", only=model_keys)
    else:  # a copy written before the tensors' view (state_dict() keys): read as it was written
        model.load_state_dict(model_sd, strict=model_keys is None)
    if task_sd:
        task.load_state_dict(task_sd)


def apply_optimizer_state(optimizer: torch.optim.Optimizer, entries: Entries, meta: Dict[str, Any], model: Optional[torch.nn.Module] = None) -> None:
    """The optimizer's part of a state (its optim.* entries, its scalars and param groups): by
    parameter name (``optim.<name>.<key>``, ``model`` names them), or by index in a copy written
    before the tensors' view."""
    by_name = meta.get("view") == VIEW
    if by_name and model is None:
        raise ValueError("apply_optimizer_state: a state keyed by parameter name needs the model")
    index_of = {n: i for i, n in enumerate(param_names(model, optimizer))} if by_name and model is not None else {}

    def index(key: str) -> Tuple[int, str]:
        where, _, k = key.rpartition(".")  # an optimizer's state keys (exp_avg, step, ...) hold no dot
        if not by_name:
            return int(where), k
        if where not in index_of:
            raise ValueError(f"the state holds optimizer state of {where!r}, which this optimizer does not step. HINT: the state must come from the same task and rank")
        return index_of[where], k

    opt_state: Dict[int, Dict[str, Any]] = {}
    for name, t in entries:
        kind, _, rest = name.partition(".")
        if kind != "optim":
            raise ValueError(f"state entry {name!r} is not the optimizer's")
        i, k = index(rest)
        opt_state.setdefault(i, {})[k] = t
    for key, v in meta.get("optim_scalars", {}).items():
        i, k = index(key)
        opt_state.setdefault(i, {})[k] = v
    optimizer.load_state_dict({"state": opt_state, "param_groups": meta["param_groups"]})


def state_sha256(entries: Entries, meta: Dict[str, Any]) -> str:
    """Fingerprint of the state: names, dtypes, shapes, raw bytes and metadata, in order."""
    h = hashlib.sha256()
    for name, t in entries:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(byte_view(t))
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


def state_nbytes(entries: Entries) -> int:
    return sum(t.numel() * t.element_size() for _, t in entries)
