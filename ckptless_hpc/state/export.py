"""The trained model a job leaves, and the full model of any saved state.

A saved state is one file (``parallel=ddp``: every rank holds it all) or one file per shard
(``zero``, ``fsdp``, ``hsdp``), each in the format of :mod:`.emergency`. The model's part of it:

- ``ddp`` and ``zero``: ``model.<name>`` entries, the model's tensors by name (the job's view,
  :mod:`.views`: a tie once, non-persistent buffers too); ZeRO's shards hold disjoint sets of
  parameters and the same buffers;
- ``fsdp`` and ``hsdp``: ``param/<name>``, each parameter's dim-0 shard (FSDP2's ``Shard(0)``:
  the shards of one shard group, in shard order, concatenate to the whole tensor), and
  ``buffer/<name>``, each buffer whole (the same on every rank).

:func:`full_model` joins them into the model's whole tensors (:func:`job_view`) and presents
them as the model's own ``state_dict()`` (the user's view: tied aliases equal to their tensor,
no non-persistent buffer, keys a ``state_dict`` hook makes made by a fresh model), loadable with
``model.load_state_dict(...)`` into the task's ``build_model()``. Every state carries the map
between the two views (``meta["user_view"]``); a copy written before it existed is read with its
index's key map, or the keys its entry names give.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..rundir.paths import DCP, DCP_SOURCE, FINAL, INDEX, SHARD_FILE, STATE, RunPaths, copy_dcp, step_of_folder
from ..rundir.record import fsync_dir, remove_quietly, write_failure
from . import dcp, emergency
from .snapshot import state_sha256
from .views import UserView, present


class ExportError(Exception):
    """Nothing to export at the path, or its files do not make a whole model; the message names
    the path and what to do."""


class NoCopyBeside(ExportError):
    """A DCP folder whose job's copy is not where its copy.json says (moved away, written by
    someone else): ``export`` reads the checkpoint itself, ``resume_from`` refuses it."""


def job_view(shards: Sequence[Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]]) -> Dict[str, torch.Tensor]:
    """The model's whole tensors (name -> tensor, the job's view: state/views.py) from the entries
    of every shard, in shard order: ``model.<name>`` whole (the first shard's where several hold
    it), ``param/<name>`` shards joined (FSDP2: along dim 0; tensor parallel: along the dimension
    ``meta["shard_dims"]`` names, whole where it names none; tp x shard: both, state/dcp.py
    :func:`~.dcp.join`), ``buffer/<name>`` whole."""
    whole: Dict[str, torch.Tensor] = {}
    parts: Dict[str, List[torch.Tensor]] = {}
    join = dcp.joiner(shards)
    for entries, _ in shards:
        for name, t in entries:
            if name.startswith("param/"):
                parts.setdefault(name[len("param/") :], []).append(t)
            elif name.startswith("model."):
                whole.setdefault(name[len("model.") :], t)
            elif name.startswith("buffer/"):
                whole.setdefault(name[len("buffer/") :], t)
    whole.update({n: join(n, ps) for n, ps in parts.items()})
    return whole


def full_model(
    shards: Sequence[Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]],
    legacy_keys: Optional[Mapping[str, str]] = None,
    view: Optional[UserView] = None,
    build_model: Optional[Callable[[], torch.nn.Module]] = None,
) -> Dict[str, torch.Tensor]:
    """The model's full ``state_dict()`` (the user's view) from the entries of every shard, in
    shard order. The view is the one the state carries (``meta["user_view"]``) or ``view``; a
    model whose ``state_dict`` hooks make keys of their own is presented by a fresh model from
    ``build_model``. A copy written before the views (no ``user_view``) is read as it was written:
    its index's key map (``legacy_keys``), else the keys its entry names give."""
    tensors = job_view(shards)
    recorded = shards[0][1].get("user_view") if shards else None
    if view is None and recorded is not None:
        view = UserView.from_json(recorded, list(tensors))
    if view is not None:
        try:
            out = present(tensors, view, build_model)
        except KeyError as e:
            raise ExportError(f"{e.args[0]}. HINT: export a complete copy (every shard file)") from None
        except ValueError as e:
            raise ExportError(str(e)) from None
        return {k: v.clone() for k, v in out.items()}
    keys = {k: n.split(".", 1)[1] if n.startswith("model.") else n.split("/", 1)[1] for k, n in legacy_keys.items()} if legacy_keys else {n: n for n in tensors}
    missing = sorted(k for k, n in keys.items() if n not in tensors)
    if missing:
        raise ExportError(
            f"the saved state lacks {len(missing)} tensor(s) of the model ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}). HINT: export a complete copy (every shard file)"
        )
    return {k: tensors[n].clone() for k, n in keys.items()}


def shard_files(path: str) -> Tuple[List[str], Optional[Dict[str, Any]]]:
    """The state files at ``path`` in shard order, and the index when there is one. ``path`` is a
    state file, a folder of shard files (with or without an index), a ``final/`` folder, a DCP
    folder of a saved copy (the copy its copy.json names: state/dcp.py), or a run directory (its
    final state, else its newest periodic copy, else the copy its restart.json names)."""
    if os.path.isfile(path):
        return [path], None
    if not os.path.isdir(path):
        raise ExportError(f"{path} does not exist. HINT: give a run directory, its final/ folder, a state folder or a state file")
    if dcp.is_checkpoint(path):
        return _copy_of_dcp(path)
    for sub in (os.path.join(FINAL, STATE), STATE):
        if os.path.isfile(os.path.join(path, sub, INDEX)):
            return shard_files(os.path.join(path, sub))
    final = os.path.join(path, FINAL, STATE)
    if os.path.isdir(final) and any(SHARD_FILE.match(n) for n in os.listdir(final)):  # shard files, no index (a save cut short before it)
        return shard_files(final)
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


def _copy_of_dcp(path: str) -> Tuple[List[str], Dict[str, Any]]:
    """The files of the copy the DCP folder at ``path`` was written from, and its copy.json as
    the index (each file's state sha256, the step)."""
    source = dcp.read_source(path)
    if source is None:
        raise NoCopyBeside(
            f"{path} is a DCP checkpoint that names no copy of this job (no {DCP_SOURCE} in it). HINT: resume_from the saved copy it came from; dcp.load reads it (docs/tasks.md)"
        )
    files = [os.path.normpath(os.path.join(path, rec["file"])) for _, rec in sorted(source["files"].items(), key=lambda kv: int(kv[0]))]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise NoCopyBeside(
            f"{path} is the DCP checkpoint of a copy of step {source['step']} whose files are not where it says ({', '.join(missing[:2])}). "
            "HINT: resume_from needs the job's own copy: put the DCP folder back in its copy's folder, or give the copy itself (export --format pt reads the checkpoint alone)"
        )
    return files, source


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
        held = {emergency.step_of(f) for f in files} if dcp.is_checkpoint(path) else {step}
        if held != {step}:  # a DCP folder left beside a copy written over since (a newer emergency copy)
            raise ExportError(
                f"{path} is the DCP checkpoint of step {step}, but the copy it names now holds step(s) {sorted(map(str, held))}. HINT: give the copy itself (its folder or file)"
            )
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


def load_full_model(path: str, build_model: Optional[Callable[[], torch.nn.Module]] = None) -> Dict[str, torch.Tensor]:
    """The full model of the saved state at ``path`` (see :func:`shard_files`), every file checked;
    ``build_model``: the task's, for a model whose ``state_dict`` hooks make keys of their own."""
    try:
        shards, index = load_shards(path)
    except NoCopyBeside:  # a DCP folder alone: its own model part
        try:
            return dcp.load_model(path)
        except Exception as e:  # noqa: BLE001 - torch's reader: any failure names the folder
            raise ExportError(f"cannot read the DCP checkpoint {path}: {type(e).__name__}: {e}") from None
    return full_model(shards, (index or {}).get("model_keys"), build_model=build_model)


def export_dcp(path: str, out: str, build_model: Optional[Callable[[], torch.nn.Module]] = None) -> Dict[str, Any]:
    """The whole saved state at ``path`` as one DCP checkpoint at ``out`` (state/dcp.py), naming
    the copy it is written from (its copy.json)."""
    files, index = shard_files(path)
    return copy_to_dcp(files, out, [(index or {}).get("files", {}).get(str(i), {}).get("state_sha256") for i in range(len(files))], build_model, (index or {}).get("model_keys"))


def copy_to_dcp(
    files: Sequence[str],
    out: Optional[str] = None,
    shas: Optional[Sequence[Optional[str]]] = None,
    build_model: Optional[Callable[[], torch.nn.Module]] = None,
    legacy_keys: Optional[Mapping[str, str]] = None,
) -> Dict[str, Any]:
    """The saved copy whose state files are ``files`` (shard order; each checked, and against
    ``shas`` where given) as one DCP checkpoint at ``out`` (default: the copy's own, paths.copy_dcp);
    its record. Raises ExportError."""
    out = out or copy_dcp(os.path.dirname(files[0]))
    shards, got = [], []
    try:
        for i, f in enumerate(files):
            entries, meta, sha = emergency.read_checked(f, (shas or [None] * len(files))[i])
            shards.append((entries, meta))
            got.append(sha)
    except emergency.EmergencyCopyError as e:
        raise ExportError(str(e)) from None
    steps = sorted({int(meta["step"]) for _, meta in shards})
    if len(steps) > 1:
        raise ExportError(f"{os.path.dirname(files[0])}: its shard files hold different steps ({steps}). HINT: export a complete copy of one step (every shard file of it)")
    user = full_model(shards, legacy_keys, build_model=build_model)
    try:
        return dcp.write(out, shards, user, dcp.source_of(out, steps[0], files, got))
    except OSError as e:
        raise ExportError(f"cannot write {out}: {write_failure(e, out)}") from None
    except ValueError as e:
        raise ExportError(f"{files[0]}: {e}") from None


def load_shards(path: str) -> Tuple[List[Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]], Optional[Dict[str, Any]]]:
    """Every shard of the saved state at ``path`` (entries, meta), each file checked, all of one step; and its index."""
    files, index = shard_files(path)
    try:
        shards = [emergency.read(f, (index or {}).get("files", {}).get(str(i), {}).get("state_sha256")) for i, f in enumerate(files)]
    except emergency.EmergencyCopyError as e:
        raise ExportError(str(e)) from None
    steps = sorted({int(meta["step"]) for _, meta in shards})
    if len(steps) > 1:
        raise ExportError(f"{path}: its shard files hold different steps ({steps}). HINT: export a complete copy of one step (every shard file of it)")
    return shards, index


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


FORMATS = ("pt", "safetensors", "dcp")


def format_of(path: str, fmt: Optional[str] = None) -> str:
    """The file format asked for, else the one ``path``'s suffix names (``.safetensors``), else pt."""
    if fmt is None:
        return "safetensors" if path.endswith(".safetensors") else "pt"
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}. HINT: --format pt (torch.load), safetensors, or dcp (a folder: the whole state)")
    return fmt


def write_model(state_dict: Mapping[str, torch.Tensor], path: str, fmt: str = "pt") -> Dict[str, Any]:
    """The full model to ``path``: ``pt`` (``torch.load(path, weights_only=True)`` gives it back)
    or ``safetensors`` (``safetensors.torch.load_file``; every tensor its own, contiguous)."""
    sd = {k: v.detach().cpu() for k, v in state_dict.items()}
    if fmt == "safetensors":
        try:
            from safetensors.torch import save as st_save
        except ImportError:
            raise ExportError("--format safetensors needs the safetensors package. HINT: pip install safetensors (or write --format pt)") from None
        blob = st_save({k: v.contiguous().clone() for k, v in sd.items()}, metadata={"format": "pt"})
        write = lambda f: f.write(blob)  # noqa: E731
    else:
        write = lambda f: torch.save(sd, f)  # noqa: E731
    try:
        return write_atomic(path, write)
    except (OSError, RuntimeError) as e:
        cause = emergency._os_error_in(e)
        raise ExportError(f"cannot write the model to {path}: {write_failure(cause or e, path)}") from None


def write_final(
    state_dir: str, files: Sequence[str], out: str, step: int, mode: str, view: Optional[UserView] = None, build_model: Optional[Callable[[], torch.nn.Module]] = None
) -> Dict[str, Any]:
    """The final state's index (every state file with its sha256) and its full model, the user's
    view of the live model (``view``; ``build_model`` presents keys its hooks make)."""
    shards = []
    recs: Dict[str, Dict[str, Any]] = {}
    for i, f in enumerate(files):
        try:
            entries, meta = emergency.read(f)
        except emergency.EmergencyCopyError as e:
            raise ExportError(str(e)) from None
        shards.append((entries, meta))
        recs[str(i)] = {"file": os.path.relpath(f, state_dir), "sha256": file_sha256(f), "bytes": os.path.getsize(f), "state_sha256": state_sha256(entries, meta)}
    user = full_model(shards, view=view, build_model=build_model)
    model = write_model(user, out)
    dcp_dir = os.path.join(os.path.dirname(out), DCP)
    try:
        dcp_rec = dcp.write(dcp_dir, shards, user, dcp.source_of(dcp_dir, step, files, [r["state_sha256"] for _, r in sorted(recs.items(), key=lambda kv: int(kv[0]))]))
    except OSError as e:
        raise ExportError(f"cannot write {dcp_dir}: {write_failure(e, dcp_dir)}") from None
    except ValueError as e:
        raise ExportError(f"cannot write {dcp_dir}: {e}") from None
    index = {
        "format": 1,
        "mode": mode,
        "step": step,
        "files": recs,
        "model": {"file": os.path.relpath(out, state_dir), "sha256": model["sha256"]},
        "dcp": os.path.relpath(dcp_dir, state_dir),
    }
    text = json.dumps(index, indent=2).encode()
    try:
        idx = write_atomic(os.path.join(state_dir, INDEX), lambda fh: fh.write(text))
    except OSError as e:
        raise ExportError(f"cannot write {os.path.join(state_dir, INDEX)}: {write_failure(e, state_dir)}") from None
    return {"model": model, "state": {"path": state_dir, "index": idx["path"], "files": recs, "dcp": dcp_rec}}
