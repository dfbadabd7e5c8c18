"""The task config checked without building anything (``dry_run=true``): the ``_target_`` class
is imported and the given keyword arguments are matched against its constructor's signature
(through ``**kwargs`` passed on to a base class's constructor), so a wrong ``_target_``, a
misspelled argument or the wrong override form fails in a second with the field, the value seen
and a HINT, not after the workers started. Also the global batch the start line shows."""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Dict, List, Optional, Tuple

_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
_REPLACE = "~task +task._target_=pkg.module.Class (+task.arg=value ...)"


def locate(target: Any) -> Tuple[Optional[Any], Optional[str]]:
    """(the object ``target`` names, None) or (None, why not)."""
    if not isinstance(target, str) or "." not in target:
        return None, f"task._target_={target!r} is not a dotted path to a class. HINT: e.g. task._target_=examples.plain_loop.RegressionTask, or pick a task group: task=mlp"
    module, _, name = target.rpartition(".")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return None, (
            f"task._target_={target!r}: module {module!r} cannot be imported ({e}). HINT: run from the directory that holds "
            "the package (the workers import it the same way), pip install it, or check the spelling"
        )
    obj = getattr(mod, name, None)
    if obj is None:
        near = difflib.get_close_matches(name, [n for n in dir(mod) if not n.startswith("_")], n=3)
        also = f"; did you mean {', '.join(near)}?" if near else ""
        return None, f"task._target_={target!r}: module {module!r} has no {name!r}. HINT: check the class name{also}"
    if not callable(obj):
        return None, f"task._target_={target!r} is a {type(obj).__name__}, not a class. HINT: name the task class (a subclass of ckptless_hpc.tasks.base.Task)"
    return obj, None


def accepted(cls: Any) -> Tuple[Dict[str, inspect.Parameter], bool]:
    """The keyword arguments ``cls(...)`` takes, following ``**kwargs`` up the bases' constructors;
    and whether any name at all is taken (a ``**kwargs`` that reaches no named signature)."""
    params: Dict[str, inspect.Parameter] = {}
    classes = [c for c in getattr(cls, "__mro__", ()) if "__init__" in vars(c) and c is not object] or [cls]
    for c in classes:
        try:
            sig = inspect.signature(c.__init__ if isinstance(c, type) else c)
        except (TypeError, ValueError):
            return params, True
        own = [p for n, p in sig.parameters.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        for p in own:
            params.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            return params, False
    return params, True


def task_errors(task_cfg: Any) -> List[str]:
    """What is wrong with the ``task`` config group, without building the task (empty: nothing)."""
    if task_cfg is None or "_target_" not in task_cfg:
        return [f"task._target_ is missing. HINT: pick a task group (task=mlp), or name a class: {_REPLACE}"]
    target = task_cfg["_target_"]
    obj, why = locate(target)
    if why is not None:
        return [why]
    params, open_ended = accepted(obj)
    given = [k for k in task_cfg if k not in _HYDRA_KEYS]
    errors = []
    unknown = [k for k in given if k not in params]
    if unknown and not open_ended:
        sig = f"{obj.__name__}(" + ", ".join(f"{n}={p.default!r}" if p.default is not p.empty else n for n, p in params.items()) + ")"
        far = []
        for k in unknown:
            near = difflib.get_close_matches(k, list(params), n=1)
            if near:
                errors.append(f"task.{k}={task_cfg[k]!r}: {sig} takes no argument {k!r}. HINT: did you mean task.{near[0]}?")
            else:
                far.append(k)
        if far:
            errors.append(
                ", ".join(f"task.{k}={task_cfg[k]!r}" for k in far) + f": {sig} takes no such argument{'s' if len(far) > 1 else ''} (task._target_={target!r}). "
                f"HINT: an override task._target_=... keeps the other arguments of the task group in use; to name a class alone: {_REPLACE}"
            )
    missing = [n for n, p in params.items() if p.default is p.empty and n not in given]
    for n in missing:
        errors.append(f"task.{n} is missing: {obj.__name__} requires it. HINT: +task.{n}=<value> (or set it in the task's YAML)")
    return errors


def batch_size(cfg: Any) -> Any:
    """The task's batch size: its config's, else its constructor's default (imports the class)."""
    task = cfg.get("task")
    if task is None or "_target_" not in task:
        return None
    if task.get("batch_size") is not None:
        return task.batch_size
    obj, _ = locate(task._target_)
    p = accepted(obj)[0].get("batch_size") if obj is not None else None
    return p.default if p is not None and p.default is not p.empty else None
