"""What workers tell the coordinator, as typed messages parsed from the wire (pure, no I/O).

``parse`` checks every field a decision reads and raises ``MessageError`` naming the message,
the field and the value seen. Heartbeats are not parsed here: they are the one message sent
per rank every interval, and the coordinator reads its two fields in place.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, List, Optional, Tuple, Type, Union


class MessageError(ValueError):
    pass


@dataclass(frozen=True)
class Built:
    state_port: int
    state_bytes: Optional[int] = None
    params: Optional[int] = None
    buckets: Optional[int] = None
    buffers: Optional[int] = None


@dataclass(frozen=True)
class Metrics:
    step: int
    loss: float
    step_s: float
    gen: Optional[int] = None
    lr: Optional[float] = None
    grad_norm: Optional[float] = None
    samples: Optional[float] = None
    skipped: Optional[str] = None
    skipped_total: Optional[Dict[str, int]] = None
    metrics: Optional[Dict[str, float]] = None  # the task's own (train/<name>), global means


@dataclass(frozen=True)
class Eval:
    """Rank 0's evaluation after ``step`` committed steps: the task's metrics, means over the batches."""

    step: int
    metrics: Dict[str, float]
    gen: Optional[int] = None
    eval_s: Optional[float] = None


@dataclass(frozen=True)
class Held:
    gen: Optional[int] = None  # the generation it was in
    abort_gen: Optional[int] = None  # the abort it answers; None: it reports a collective error
    step: Optional[int] = None  # its committed step
    pid: Optional[int] = None
    reason: Optional[str] = None
    inventory: Optional[Dict[str, Any]] = None  # sharded: shard id -> steps it can serve
    blame: Optional[List[str]] = None  # start failed: the state sources that could not serve it


@dataclass(frozen=True)
class Joining:
    gen: int
    step: Optional[int] = None


@dataclass(frozen=True)
class Ready:
    gen: int
    rank: Optional[int] = None
    pid: Optional[int] = None
    form_s: Optional[float] = None


@dataclass(frozen=True)
class Fetched:
    gen: int
    source: Optional[str] = None
    bytes: int = 0
    seconds: float = 0.0
    apply_s: Optional[float] = None


@dataclass(frozen=True)
class TransferFailed:
    gen: Optional[int] = None
    source: Optional[str] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class FaultFired:
    index: int
    kind: Optional[str] = None
    at: Optional[str] = None
    gen: Optional[int] = None
    rank: Optional[int] = None
    step: Optional[int] = None
    pid: Optional[int] = None


@dataclass(frozen=True)
class Done:
    gen: int
    sha256: str
    rank: Optional[int] = None
    step: Optional[int] = None
    shard: Optional[int] = None  # sharded: the shard this sha256 is of
    copies_bytes: Optional[Dict[str, int]] = None  # sharded: host bytes of its own snapshots and held copies
    copy_costs: Optional[Dict[str, float]] = None  # sharded: seconds its steps waited for acks, snapshots, bytes sent


@dataclass(frozen=True)
class Saved:
    path: str
    step: int
    sha256: str
    shard: Optional[int] = None  # sharded: one shard's copy
    bytes: Optional[int] = None
    written: Optional[bool] = None  # False: a newer copy was already there and is kept


@dataclass(frozen=True)
class SaveFailed:
    path: str
    error: str
    step: Optional[int] = None


@dataclass(frozen=True)
class Exported:
    """The final state's full model and index are written (state/export.py)."""

    step: int
    model: Dict[str, Any]  # path, sha256 (of the file), bytes
    state: Dict[str, Any]  # path, index, files: shard -> file, sha256, bytes, state_sha256


@dataclass(frozen=True)
class PeriodicSaved:
    """One piece of a copy of train.save_every is written (worker/periodic.py)."""

    path: str
    step: int
    shard: int
    state_sha256: str
    sha256: Optional[str] = None  # of the file
    bytes: Optional[int] = None


@dataclass(frozen=True)
class PeriodicFailed:
    path: str
    error: str
    step: Optional[int] = None


@dataclass(frozen=True)
class ExportFailed:
    path: str
    error: str


@dataclass(frozen=True)
class LoadFailed:
    path: str
    error: str


@dataclass(frozen=True)
class NonFinite:
    step: Optional[int] = None
    loss: Any = None  # "nan" / "inf" strings or numbers
    grad_norm: Any = None
    rank: Optional[int] = None
    gen: Optional[int] = None
    held: Optional[int] = None
    skipped: Optional[int] = None  # on_nonfinite=skip: refused because this many steps were dropped already (train.max_skipped_fraction)


@dataclass(frozen=True)
class StartupError:
    traceback: str = ""


Message = Union[Built, Metrics, Eval, Held, Joining, Ready, Fetched, TransferFailed, FaultFired, Done, Saved, SaveFailed, LoadFailed, NonFinite, StartupError, Exported, ExportFailed, PeriodicSaved, PeriodicFailed]
KINDS: Dict[str, Type[Any]] = {
    "built": Built, "metrics": Metrics, "eval": Eval, "held": Held, "joining": Joining, "ready": Ready, "fetched": Fetched,
    "transfer_error": TransferFailed, "fault": FaultFired, "done": Done, "saved": Saved, "nonfinite": NonFinite,
    "startup_error": StartupError, "save_failed": SaveFailed, "load_failed": LoadFailed,
    "exported": Exported, "export_failed": ExportFailed, "periodic_saved": PeriodicSaved, "periodic_failed": PeriodicFailed,
}
_NUMBER = (int, float)
_CHECKS = {int: _NUMBER, float: _NUMBER, str: (str,)}


def _check(kind: str, name: str, base: Optional[type], value: Any, required: bool) -> Any:
    if value is None:
        if required:
            raise MessageError(f"{kind!r} message: field {name!r} is missing. HINT: worker and coordinator must be the same ckptless_hpc version")
        return None
    integral = base is not int or not isinstance(value, float) or value.is_integer()
    if base is not None and (not isinstance(value, _CHECKS[base]) or isinstance(value, bool) or not integral):
        raise MessageError(f"{kind!r} message: field {name!r} = {value!r} is not of type {base.__name__}. HINT: worker and coordinator must be the same ckptless_hpc version")
    return int(value) if base is int and isinstance(value, float) and value.is_integer() else value


Spec = Tuple[str, Optional[type], bool, Any, Tuple[type, ...]]  # field name, its checked type (None: any), required, default, types taken as they are


def _spec(cls: Type[Any]) -> List[Spec]:
    """What ``parse`` checks of each field, worked out once per kind (it runs for every message
    of a recovery: held, joining, ready from every rank)."""
    out = []
    for f in fields(cls):
        base = {"int": int, "float": float, "str": str}.get(str(f.type).replace("Optional[", "").rstrip("]"))
        exact = {int: (int,), float: (int, float), str: (str,)}.get(base, ())  # type: ignore[arg-type]
        out.append((f.name, base, f.default is MISSING and f.default_factory is MISSING, f.default, exact))
    return out


_SPECS: Dict[str, List[Spec]] = {kind: _spec(cls) for kind, cls in KINDS.items()}
_ABSENT = object()


def parse(msg: Dict[str, Any]) -> Optional[Message]:
    """The typed message, or None for a kind this coordinator does not know. A value of exactly
    its field's type is taken as it is (the common case, checked inline); the rest is checked
    (and an integral float converted) by ``_check``, which also names what is wrong."""
    kind = msg.get("type")
    spec = _SPECS.get(kind)  # type: ignore[arg-type]
    if spec is None:
        return None
    args = []
    for name, base, required, default, exact in spec:
        value = msg.get(name, _ABSENT)
        if value is _ABSENT:
            args.append(_check(kind, name, base, None, True) if required else default)  # type: ignore[arg-type]
        elif value is not None and (base is None or type(value) in exact):
            args.append(value)
        else:
            args.append(_check(kind, name, base, value, required))  # type: ignore[arg-type]
    return KINDS[kind](*args)  # type: ignore[index]
