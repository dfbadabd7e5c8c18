"""The trained model a job leaves, and the full model of any saved state.

A saved state is one file (``parallel=ddp``: every rank holds it all) or one file per shard
(``zero``, ``fsdp``, ``hsdp``), each in the format of :mod:`.emergency`. The model's part of it:

- ``ddp`` and ``zero``: ``model.<key>`` entries, keys of the model's ``state_dict()``; ZeRO's
  shards hold disjoint sets of parameters and the same buffers;
- ``fsdp`` and ``hsdp``: ``param/<fqn>``, each parameter's dim-0 shard (FSDP2's ``Shard(0)``:
  the shards of one shard group, in shard order, concatenate to the whole tensor), and
  ``buffer/<fqn>``, each buffer whole (the same on every rank).

:func:`full_model` joins them into the model's full ``state_dict()``, loadable with
``model.load_state_dict(...)`` into the task's ``build_model()``. A key map (``state_dict`` key ->
entry name, from :func:`key_map` of the live model) gives exactly the model's keys, tied
parameters and non-persistent buffers included; without one (an emergency copy), the keys are
derived from the entry names. The final state's ``index.json`` carries its key map.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..rundir.paths import FINAL, INDEX, SHARD_FILE, STATE, RunPaths, step_of_folder
from ..rundir.record import fsync_dir, remove_quietly, write_failure
from . import emergency
from .snapshot import state_sha256


class ExportError(Exception):
    """Nothing to export at the path, or its files do not make a whole model; the message names
    the path and what to do."""


def key_map(model: torch.nn.Module, sharded_params: bool) -> Dict[str, str]:
    """``state_dict`` key -> the entry that holds it, for this model (``sharded_params``: the
    FSDP2 naming ``param/`` and ``buffer/``; otherwise ``model.<key>``). A tied parameter maps to
    the entry of its first name, as ``named_parameters`` gives it."""
    sd = model.state_dict(keep_vars=True)
    if not sharded_params:
        return {k: f"model.{k}" for k in sd}
    first = {id(p): n for n, p in model.named_parameters()}
    return {k: f"param/{first[id(v)]}" if id(v) in first else f"buffer/{k}" for k, v in sd.items()}


def full_model(shards: Sequence[Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]], keys: Optional[Mapping[str, str]] = None) -> Dict[str, torch.Tensor]:
    """The model's full state dict from the entries of every shard, in shard order."""
    whole: Dict[str, torch.Tensor] = {}
    parts: Dict[str, List[torch.Tensor]] = {}
    for entries, _ in shards:
        for name, t in entries:
            if name.startswith("param/"):
                parts.setdefault(name, []).append(t)
            elif name.startswith(("model.", "buffer/")):
                whole.setdefault(name, t)
    whole.update({n: torch.cat(ps) if len(ps) > 1 and ps[0].dim() > 0 else ps[0] for n, ps in parts.items()})
    if keys is None:
        keys = {n.split(".", 1)[1] if n.startswith("model.") else n.split("/", 1)[1]: n for n in whole}
    missing = sorted(k for k, n in keys.items() if n not in whole)
    if missing:
        raise ExportError(
            f"the saved state lacks {len(missing)} tensor(s) of the model ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}). HINT: export a complete copy (every shard file)"
        )
    return {k: whole[n].clone() for k, n in keys.items()}


def shard_files(path: str) -> Tuple[List[str], Optional[Dict[str, Any]]]:
    """The state files at ``path`` in shard order, and the index when there is one. ``path`` is a
    state file, a folder of shard files (with or without an index), a ``final/`` folder, or a
    run directory (its final state, else its newest periodic copy, else the copy its
    restart.json names)."""
    if os.path.isfile(path):
        return [path], None
    if not os.path.isdir(path):
        raise ExportError(f"{path} does not exist. HINT: give a run directory, its final/ folder, a state folder or a state file")
    for sub in (os.path.join(FINAL, STATE), STATE):
        if os.path.isfile(os.path.join(path, sub, INDEX)):
            return shard_files(os.path.join(path, sub))
    index_path = os.path.join(path, INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        return [os.path.join(path, rec["file"]) for _, rec in sorted(index["files"].items(), key=lambda kv: int(kv[0]))], index
    shards = sorted((int(m.group(1)), n) for n in os.listdir(path) if (m := SHARD_FILE.match(n)))
    if shards:
        if [k for k, _ in shards] != list(range(len(shards))):
            raise ExportError(f"{path} holds shards {[k for k, _ in shards]}, not 0..{len(shards) - 1}. HINT: every shard file of the copy is needed")
        return [os.path.join(path, n) for _, n in shards], None
    saved = _newest_periodic(path) or _restart_copy(path)
    if saved is not None:
        return shard_files(saved)
    raise ExportError(
        f"no saved state at {path} (no final/state/{INDEX}, no saved/step*/{INDEX}, no shard files, no copy named in restart.json). HINT: train.save_final=true leaves RUN_DIR/final"
    )


def _newest_periodic(run_dir: str) -> Optional[str]:
    """The newest complete copy of train.save_every in ``run_dir`` (RUN_DIR/saved/step<S>/ with its index)."""
    paths = RunPaths(run_dir)
    try:
        steps = sorted((s for s in map(step_of_folder, os.listdir(paths.saved)) if s is not None), reverse=True)
    except OSError:
        return None
    return next((paths.saved_step(s) for s in steps if os.path.isfile(paths.saved_index(s))), None)


def _restart_copy(run_dir: str) -> Optional[str]:
    try:
        with open(RunPaths(run_dir).restart, encoding="utf-8") as f:
            saved = (json.load(f) or {}).get("saved")
    except (OSError, ValueError):
        return None
    return saved.get("path") if isinstance(saved, dict) else None


def resume_record(path: str, shards: int) -> Dict[str, Any]:
    """What a new job started with ``resume_from=path`` loads (the record a requeued job's
    restart.json holds: path, step, sha256, and per shard its file), for a layout of ``shards``
    shards (1: the replicated state). A copy of another number of shards is refused."""
    files, index = shard_files(os.path.abspath(path))
    if index is not None:
        step = int(index["step"])
        shas = {i: index["files"][str(i)].get("state_sha256") for i in range(len(files))}
    else:
        steps = {emergency.step_of(f) for f in files}
        if None in steps or len(steps) != 1:
            raise ExportError(f"{path}: its files are not readable copies of one step (steps {sorted(map(str, steps))}). HINT: give a complete final, periodic or emergency copy")
        step, shas = int(steps.pop()), {i: None for i in range(len(files))}
    if len(files) != shards:
        raise ExportError(
            f"resume_from={path} holds {len(files)} shard file(s); this job's layout has {shards}. "
            "HINT: resume with the parallel mode, cluster.nodes x cluster.workers_per_node (and parallel.shard_size) of the run that wrote it"
        )
    if shards == 1:
        return {"path": files[0], "step": step, "sha256": shas[0]}
    return {"path": os.path.dirname(files[0]), "step": step, "sha256": None, "shards": {str(i): {"path": f, "sha256": shas[i]} for i, f in enumerate(files)}}


def load_full_model(path: str) -> Dict[str, torch.Tensor]:
    """The full model of the saved state at ``path`` (see :func:`shard_files`), every file checked."""
    files, index = shard_files(path)
    try:
        shards = [emergency.read(f, (index or {}).get("files", {}).get(str(i), {}).get("state_sha256")) for i, f in enumerate(files)]
    except emergency.EmergencyCopyError as e:
        raise ExportError(str(e)) from None
    return full_model(shards, (index or {}).get("model_keys"))


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: str, write: Any) -> Dict[str, Any]:
    """``write(file)`` into a temporary file next to ``path`` (mode 0600), fsync, rename over
    ``path``: a full disk or a crash leaves what was there untouched. Its record."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except BaseException:
        remove_quietly(tmp)
        raise
    return {"path": path, "sha256": file_sha256(path), "bytes": os.path.getsize(path)}


def write_model(state_dict: Mapping[str, torch.Tensor], path: str) -> Dict[str, Any]:
    """The full model to ``path`` (``torch.load(path, weights_only=True)`` gives it back)."""
    sd = {k: v.detach().cpu() for k, v in state_dict.items()}
    try:
        return write_atomic(path, lambda f: torch.save(sd, f))
    except (OSError, RuntimeError) as e:
        cause = emergency._os_error_in(e)
        raise ExportError(f"cannot write the model to {path}: {write_failure(cause or e, path)}") from None


def write_final(state_dir: str, files: Sequence[str], out: str, keys: Mapping[str, str], step: int, mode: str) -> Dict[str, Any]:
    """The final state's index (every state file with its sha256, the key map) and its full model."""
    shards = []
    recs: Dict[str, Dict[str, Any]] = {}
    for i, f in enumerate(files):
        try:
            entries, meta = emergency.read(f)
        except emergency.EmergencyCopyError as e:
            raise ExportError(str(e)) from None
        shards.append((entries, meta))
        recs[str(i)] = {"file": os.path.relpath(f, state_dir), "sha256": file_sha256(f), "bytes": os.path.getsize(f), "state_sha256": state_sha256(entries, meta)}
    model = write_model(full_model(shards, keys), out)
    index = {"format": 1, "mode": mode, "step": step, "files": recs, "model": {"file": os.path.relpath(out, state_dir), "sha256": model["sha256"]}, "model_keys": dict(keys)}
    text = json.dumps(index, indent=2).encode()
    try:
        idx = write_atomic(os.path.join(state_dir, INDEX), lambda fh: fh.write(text))
    except OSError as e:
        raise ExportError(f"cannot write {os.path.join(state_dir, INDEX)}: {write_failure(e, state_dir)}") from None
    return {"model": model, "state": {"path": state_dir, "index": idx["path"], "files": recs}}
