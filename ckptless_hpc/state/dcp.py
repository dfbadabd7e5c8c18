"""A saved state as a torch.distributed.checkpoint (DCP) checkpoint a user restores without this package.

The job's own copies (one checksummed file per shard, :mod:`.emergency`) stay what recovery
reads and what ``resume_from`` loads. Every saved state is also written as DCP: one checkpoint
of the whole state, ``{"model": ..., "optim": ...}``, laid out as torch's own state-dict API
presents it (``torch.distributed.checkpoint.state_dict``): ``model`` is the model's
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
Where: ``final/dcp`` (the final state, written with final/model.pt), ``dcp/`` in each periodic
copy's folder (``saved/step<S>/dcp``, worker/periodic.py) and beside each emergency copy
(``state/dcp``, ``state/emergency-step<S>/dcp``, worker/storage.py): rundir/paths.py ``copy_dcp``.
``ckptless-hpc export --format dcp`` writes any saved state so.

Each DCP folder also holds ``copy.json`` (:data:`~ckptless_hpc.rundir.paths.DCP_SOURCE`): the
job's copy it was written from (its files, relative to the folder, each with its state's
sha256, and the step), which DCP itself ignores. ``resume_from`` and ``export`` given a DCP
folder read that copy, checked as any copy is (state/export.py ``shard_files``); ``export`` reads
a DCP folder without it (moved away, or written by someone else) from the checkpoint itself
(:func:`load_model`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..rundir.paths import DCP_SOURCE

Shard = Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]

METADATA = ".metadata"  # torch's own: the file that makes a folder a DCP checkpoint (FileSystemWriter)


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
    join = joiner(shards)
    for (fqn, key), ts in parts.items():
        state.setdefault(fqn, {})[key] = join(fqn, ts)
    return {"state": state, "param_groups": groups}


def shard_dims(shards: Sequence[Tuple[Any, Dict[str, Any]]]) -> Optional[Dict[str, int]]:
    """Tensor parallel: the dimension each sharded parameter is split along, over every shard's
    ``meta["shard_dims"]`` (pp x tp: each stage's ranks name their own stage's); None without TP."""
    metas = [m["shard_dims"] for _, m in shards if m.get("shard_dims") is not None]
    return {n: d for dims in metas for n, d in dims.items()} if metas else None


def joiner(shards: Sequence[Tuple[Any, Dict[str, Any]]]) -> Any:
    """``join(name, parts)``: one parameter's (or its optimizer state's) whole tensor from its
    pieces in shard order, for the layout the shards' metadata names (:func:`join`)."""
    dims = shard_dims(shards)
    fsdp = next((int(m["fsdp_shards"]) for _, m in shards if m.get("fsdp_shards")), None)
    if dims is None:  # fsdp, hsdp: FSDP2's dim-0 shards, every piece one
        return lambda name, parts: join(parts, None, len(parts))
    return lambda name, parts: join(parts, dims.get(name), fsdp or 1)


def join(parts: Sequence[torch.Tensor], tp_dim: Optional[int], fsdp_shards: int) -> torch.Tensor:
    """One tensor from its pieces in shard order, piece ``s*T + t`` FSDP2 shard ``s`` of TP rank
    ``t``'s part: each TP rank's FSDP2 dim-0 shards concatenated (``fsdp_shards`` of them: 1
    without FSDP), then the TP ranks' parts along ``tp_dim`` (None: not TP-sharded, the same in
    every TP rank). A 0-dim tensor (Adam's step) is the same everywhere."""
    if len(parts) == 1 or parts[0].dim() == 0:
        return parts[0]
    n_tp = len(parts) // fsdp_shards
    per_tp = [torch.cat(list(parts[t::n_tp])) if fsdp_shards > 1 else parts[t] for t in range(n_tp)]
    return per_tp[0] if tp_dim is None or n_tp == 1 else torch.cat(per_tp, dim=tp_dim)


def _merge_groups(into: List[Dict[str, Any]], groups: List[Dict[str, Any]]) -> None:
    """Param groups of several shards (the same groups, each with its own parameters): one list."""
    for i, g in enumerate(groups):
        if i == len(into):
            into.append(dict(g, params=list(g["params"])))
        else:
            into[i]["params"] += [p for p in g["params"] if p not in into[i]["params"]]


def write(out_dir: str, shards: Sequence[Shard], model_state: Dict[str, torch.Tensor], source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One DCP checkpoint of the whole state at ``out_dir`` (``model_state``: the user's view of
    the model, export.full_model), written beside and renamed into place; its record. ``source``:
    the job's copy it is written from (:func:`source_of`), kept as ``copy.json`` in the folder."""
    import torch.distributed.checkpoint as dcp

    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    sd = {"model": {k: v.detach().cpu().clone() for k, v in model_state.items()}, "optim": optimizer_state(shards)}
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        if source is not None:
            with open(os.path.join(tmp, DCP_SOURCE), "w", encoding="utf-8") as f:
                json.dump(source, f, indent=2)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": out_dir, "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))}


def source_of(out_dir: str, step: int, files: Sequence[str], shas: Sequence[str]) -> Dict[str, Any]:
    """``copy.json`` of a DCP folder at ``out_dir`` written from the copy whose state files are
    ``files`` (shard order) with their states' sha256 ``shas``: an index (as index.json's) whose
    files are named relative to the folder."""
    rel = lambda f: os.path.relpath(os.path.abspath(f), os.path.abspath(out_dir))  # noqa: E731
    return {"format": 1, "step": int(step), "files": {str(i): {"file": rel(f), "state_sha256": sha} for i, (f, sha) in enumerate(zip(files, shas))}}


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a DCP checkpoint folder (torch's ``.metadata`` in it)."""
    return os.path.isfile(os.path.join(path, METADATA))


def read_source(path: str) -> Optional[Dict[str, Any]]:
    """The ``copy.json`` of the DCP folder at ``path``, or None when it has none."""
    try:
        with open(os.path.join(path, DCP_SOURCE), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def load_model(path: str) -> Dict[str, torch.Tensor]:
    """The ``model`` part of the DCP checkpoint at ``path`` (the model's ``state_dict()``), read
    with torch's own API alone: every tensor its metadata names under ``model``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()
    model: Dict[str, torch.Tensor] = {}
    for fqn, item in md.state_dict_metadata.items():
        where = (md.planner_data or {}).get(fqn, (fqn,))
        if isinstance(item, TensorStorageMetadata) and len(where) == 2 and where[0] == "model":
            model[str(where[1])] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    if not model:
        raise ValueError(f"the DCP checkpoint {path} holds no model state (no key under 'model')")
    dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return model
