"""A saved state as a torch.distributed.checkpoint (DCP) checkpoint a user restores without this package.

The job's own copies (one checksummed file per shard, :mod:`.emergency`) stay what recovery,
``resume_from`` and ``export`` read. What a user takes away is also written as DCP: one
checkpoint of the whole state, ``{"model": ..., "optim": ...}``, laid out as torch's own
state-dict API presents it (``torch.distributed.checkpoint.state_dict``): ``model`` is the model's
``state_dict()`` (the user's view, :mod:`.views`), ``optim`` the optimizer's state keyed by
parameter name with its param groups (``get_optimizer_state_dict``'s layout). A user restores
it into their own model and optimizer (docs/tasks.md)::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(sd, checkpoint_id="RUN_DIR/final/dcp")
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])

(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into one torch.save file.)
The final state is written so at the end of a job (``final/dcp``); ``ckptless-hpc export --format
dcp`` writes any saved state so.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Sequence, Tuple

import torch

Shard = Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]


def optimizer_state(shards: Sequence[Shard]) -> Dict[str, Any]:
    """The optimizer's state of every shard by parameter name, and its param groups with the
    names of their parameters (ZeRO's parts merged, FSDP2's dim-0 shards joined), as
    ``get_optimizer_state_dict`` lays it out."""
    state: Dict[str, Dict[str, Any]] = {}
    parts: Dict[Tuple[str, str], List[torch.Tensor]] = {}
    groups: List[Dict[str, Any]] = []
    for entries, meta in shards:
        if "hyper" in meta:  # FSDP2: optim/<name>/<key>, each a dim-0 shard (a 0-dim tensor: whole)
            for name, t in entries:
                if name.startswith("optim/"):
                    fqn, _, key = name[len("optim/") :].rpartition("/")
                    parts.setdefault((fqn, key), []).append(t)
            _merge_groups(groups, [{**h, "params": list(names)} for h, names in zip(meta["hyper"], meta.get("groups") or [[] for _ in meta["hyper"]])])
            continue
        if "param_groups" not in meta:  # a model without optimizer state (a model-only copy)
            continue
        names = meta.get("param_names")
        if names is None:
            raise ValueError("the state was written before its optimizer state was kept by parameter name. HINT: export it with --format pt")
        for name, t in entries:
            if name.startswith("optim."):
                fqn, _, key = name[len("optim.") :].rpartition(".")
                state.setdefault(fqn, {})[key] = t
        for key, v in meta.get("optim_scalars", {}).items():
            fqn, _, k = key.rpartition(".")
            state.setdefault(fqn, {})[k] = v
        _merge_groups(groups, [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]} for g in meta["param_groups"]])
    dims = shards[0][1].get("shard_dims") if shards else None  # tensor parallel: the dimension each sharded parameter is split along
    for (fqn, key), ts in parts.items():
        if dims is not None and fqn not in dims:
            state.setdefault(fqn, {})[key] = ts[0]  # replicated: whole in every shard
            continue
        state.setdefault(fqn, {})[key] = torch.cat(ts, dim=(dims or {}).get(fqn, 0)) if len(ts) > 1 and ts[0].dim() > 0 else ts[0]
    return {"state": state, "param_groups": groups}


def _merge_groups(into: List[Dict[str, Any]], groups: List[Dict[str, Any]]) -> None:
    """Param groups of several shards (the same groups, each with its own parameters): one list."""
    for i, g in enumerate(groups):
        if i == len(into):
            into.append(dict(g, params=list(g["params"])))
        else:
            into[i]["params"] += [p for p in g["params"] if p not in into[i]["params"]]


def write(out_dir: str, shards: Sequence[Shard], model_state: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """One DCP checkpoint of the whole state at ``out_dir`` (``model_state``: the user's view of
    the model, export.full_model), written beside and renamed into place; its record."""
    import torch.distributed.checkpoint as dcp

    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    sd = {"model": {k: v.detach().cpu().clone() for k, v in model_state.items()}, "optim": optimizer_state(shards)}
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": out_dir, "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))}
