"""Every message of the control plane, one frozen dataclass each, both directions (pure, no I/O).

Channels: worker <-> coordinator (``TO_COORDINATOR``, ``TO_WORKER``), a node's relay link
(``RELAY``), the mutual handshake of every connection (``HANDSHAKE``), a worker's state port
(``STATE_PORT``) and the job's rendezvous store (``STORE_REQUESTS``, ``STORE_ANSWERS``).

``X(...).encode()`` is the message as it goes on the wire: a dict whose keys and key order are
the ones every sender used before these classes existed (``_WIRE``), with the fields named in
``_OMIT`` left out when they are None (``assign`` without ``rank``, ``stop`` without ``save``).
``parse(msg, kinds)`` is the reverse for the receiving end: it checks every field a decision
reads and raises ``MessageError`` naming the message, the field, the value seen and a HINT.

Heartbeats (``hb`` per rank per interval, a relay's ``hbs`` per node) are the hot path: they
are built by :func:`heartbeat` and :func:`heartbeat_summary` as plain dicts and read in place
by their receivers, never parsed into classes (bench B7: 10,000 ranks).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from enum import Enum
from typing import Any, ClassVar, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, Union, get_args

HINT_VERSION = "HINT: worker and coordinator must be the same ckptless_hpc version"


class MessageError(ValueError):
    pass


class HeldReason(str, Enum):
    """Why a worker says ``held`` (its ``reason``): the closed part of the set. Its other reasons
    are free text after a closed prefix: ``start failed: ...``, ``collective error: ...``."""

    ABORT = "abort"


START_FAILED = "start failed: "  # held.reason prefix: it could not get the state of its new generation
COLLECTIVE_ERROR = "collective error: "  # held.reason prefix: a collective failed under it


def held_reason(prefix: str, why: Any) -> str:
    """A free-text ``held`` reason after its closed prefix (START_FAILED, COLLECTIVE_ERROR)."""
    return f"{prefix}{why}"


class Part(str, Enum):
    """What of a state a ``fetch`` asks for (``part``; state/transfer.py ``Want``)."""

    ALL = "all"
    FIRST = "first"  # the parameters
    REST = "rest"  # the optimizer state


class StoreOp(str, Enum):
    """The operations of the rendezvous store (``store`` request's ``op``)."""

    SET = "set"
    GET = "get"
    WAIT = "wait"
    ADD = "add"
    CHECK = "check"
    DELETE = "delete"
    NUM_KEYS = "num_keys"
    COMPARE_SET = "compare_set"


class _Message:
    """What every message class shares: its wire type, its wire key order, its omissions."""

    TYPE: ClassVar[str] = ""
    _WIRE: ClassVar[Tuple[str, ...]] = ()  # key order on the wire; () = the fields' order
    _OMIT: ClassVar[FrozenSet[str]] = frozenset()  # keys left out when their value is None

    def encode(self) -> Dict[str, Any]:
        """The message as a dict for ``wire.encode``: today's keys, in today's order."""
        msg: Dict[str, Any] = {"type": self.TYPE}
        omit = self._OMIT
        for name in self._WIRE or _names(type(self)):
            value = getattr(self, name)
            if value is None and name in omit:
                continue
            msg[name] = value
        return msg


Encodable = _Message  # the base of every message class (annotations, isinstance)
_NAMES: Dict[type, Tuple[str, ...]] = {}


def _names(cls: type) -> Tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


# ============================================================ worker -> coordinator (control)


@dataclass(frozen=True)
class Hello(_Message):
    """A worker's first message: who it is (its connection is refused if nobody this job started)."""

    TYPE: ClassVar[str] = "hello"
    node: str
    local: int
    pid: int
    host: str
    slurm_step: Optional[str] = None


@dataclass(frozen=True)
class Built(_Message):
    TYPE: ClassVar[str] = "built"
    _WIRE: ClassVar[Tuple[str, ...]] = ("state_port", "pid", "state_bytes", "params", "buckets", "buffers")
    state_port: int
    state_bytes: Optional[int] = None
    params: Optional[int] = None
    buckets: Optional[int] = None
    buffers: Optional[int] = None
    pid: Optional[int] = None


@dataclass(frozen=True)
class Metrics(_Message):
    TYPE: ClassVar[str] = "metrics"
    _WIRE: ClassVar[Tuple[str, ...]] = ("gen", "step", "loss", "lr", "grad_norm", "step_s", "samples", "skipped", "skipped_total", "metrics")
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
class Eval(_Message):
    """Rank 0's evaluation after ``step`` committed steps: the task's metrics, means over the batches."""

    TYPE: ClassVar[str] = "eval"
    _WIRE: ClassVar[Tuple[str, ...]] = ("gen", "step", "metrics", "eval_s")
    step: int
    metrics: Dict[str, float]
    gen: Optional[int] = None
    eval_s: Optional[float] = None


@dataclass(frozen=True)
class Held(_Message):
    TYPE: ClassVar[str] = "held"
    _WIRE: ClassVar[Tuple[str, ...]] = ("gen", "abort_gen", "step", "pid", "reason", "blame", "inventory")
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"blame", "inventory"})
    gen: Optional[int] = None  # the generation it was in
    abort_gen: Optional[int] = None  # the abort it answers; None: it reports a collective error
    step: Optional[int] = None  # its committed step
    pid: Optional[int] = None
    reason: Optional[str] = None  # HeldReason.ABORT, or START_FAILED/COLLECTIVE_ERROR + why
    inventory: Optional[Dict[str, Any]] = None  # sharded: shard id -> steps it can serve
    blame: Optional[List[str]] = None  # start failed: the state sources that could not serve it

    @property
    def start_failed(self) -> bool:
        """It could not get the state of its new generation (reason ``start failed: ...``)."""
        return str(self.reason).startswith(START_FAILED.rstrip(": "))


@dataclass(frozen=True)
class Joining(_Message):
    TYPE: ClassVar[str] = "joining"
    gen: int
    step: Optional[int] = None


@dataclass(frozen=True)
class Ready(_Message):
    TYPE: ClassVar[str] = "ready"
    gen: int
    rank: Optional[int] = None
    pid: Optional[int] = None
    form_s: Optional[float] = None


@dataclass(frozen=True)
class Fetched(_Message):
    TYPE: ClassVar[str] = "fetched"
    gen: int
    source: Optional[str] = None
    bytes: int = 0
    seconds: float = 0.0
    apply_s: Optional[float] = None


@dataclass(frozen=True)
class TransferFailed(_Message):
    TYPE: ClassVar[str] = "transfer_error"
    gen: Optional[int] = None
    source: Optional[str] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class FaultFired(_Message):
    TYPE: ClassVar[str] = "fault"
    index: int
    kind: Optional[str] = None
    at: Optional[str] = None
    gen: Optional[int] = None
    rank: Optional[int] = None
    step: Optional[int] = None
    pid: Optional[int] = None


@dataclass(frozen=True)
class Done(_Message):
    TYPE: ClassVar[str] = "done"
    _WIRE: ClassVar[Tuple[str, ...]] = ("gen", "rank", "step", "sha256", "shard", "copies_bytes", "copy_costs", "adopted")
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"shard", "copies_bytes", "copy_costs", "adopted"})
    gen: int
    sha256: str
    rank: Optional[int] = None
    step: Optional[int] = None
    shard: Optional[int] = None  # sharded: the shard this sha256 is of
    copies_bytes: Optional[Dict[str, int]] = None  # sharded: host bytes of its own snapshots and held copies
    copy_costs: Optional[Dict[str, float]] = None  # sharded: seconds its steps waited for acks, snapshots, bytes sent
    adopted: Optional[Dict[str, str]] = None  # ZeRO in a job that shrank: the lost ranks' shards it steps -> their sha256


@dataclass(frozen=True)
class Saved(_Message):
    """An emergency copy (or one shard of it) is written: state/emergency.py's record, ``shard`` last."""

    TYPE: ClassVar[str] = "saved"
    _WIRE: ClassVar[Tuple[str, ...]] = ("path", "step", "sha256", "bytes", "written", "shard")
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"shard"})
    path: str
    step: int
    sha256: str
    shard: Optional[int] = None  # sharded: one shard's copy
    bytes: Optional[int] = None
    written: Optional[bool] = None  # False: a newer copy was already there and is kept


@dataclass(frozen=True)
class SaveFailed(_Message):
    TYPE: ClassVar[str] = "save_failed"
    _WIRE: ClassVar[Tuple[str, ...]] = ("path", "step", "error")
    path: str
    error: str
    step: Optional[int] = None


@dataclass(frozen=True)
class Exported(_Message):
    """The final state's full model and index are written (state/export.py)."""

    TYPE: ClassVar[str] = "exported"
    step: int
    model: Dict[str, Any]  # path, sha256 (of the file), bytes
    state: Dict[str, Any]  # path, index, files: shard -> file, sha256, bytes, state_sha256


@dataclass(frozen=True)
class PeriodicSaved(_Message):
    """One piece of a copy of train.save_every is written (worker/periodic.py)."""

    TYPE: ClassVar[str] = "periodic_saved"
    path: str
    step: int
    shard: int
    state_sha256: str
    sha256: Optional[str] = None  # of the file
    bytes: Optional[int] = None


@dataclass(frozen=True)
class PeriodicFailed(_Message):
    TYPE: ClassVar[str] = "periodic_failed"
    _WIRE: ClassVar[Tuple[str, ...]] = ("path", "step", "error")
    path: str
    error: str
    step: Optional[int] = None


@dataclass(frozen=True)
class ExportFailed(_Message):
    TYPE: ClassVar[str] = "export_failed"
    path: str
    error: str


@dataclass(frozen=True)
class LoadFailed(_Message):
    TYPE: ClassVar[str] = "load_failed"
    path: str
    error: str


@dataclass(frozen=True)
class NonFinite(_Message):
    TYPE: ClassVar[str] = "nonfinite"
    _WIRE: ClassVar[Tuple[str, ...]] = ("gen", "rank", "step", "loss", "grad_norm", "held", "skipped")
    step: Optional[int] = None
    loss: Any = None  # "nan" / "inf" strings or numbers
    grad_norm: Any = None
    rank: Optional[int] = None
    gen: Optional[int] = None
    held: Optional[int] = None
    skipped: Optional[int] = None  # on_nonfinite=skip: refused because this many steps were dropped already (train.max_skipped_fraction)


@dataclass(frozen=True)
class StartupError(_Message):
    TYPE: ClassVar[str] = "startup_error"
    traceback: str = ""


@dataclass(frozen=True)
class WorkerFailed(_Message):
    """A worker's own error while it trains (a bug, a model its mode cannot carry): the job's
    error, never a lost worker to recover (a replacement would hit it again)."""

    TYPE: ClassVar[str] = "worker_failed"
    traceback: str = ""
    during: str = ""  # rank, generation, step and the message it was handling


@dataclass(frozen=True)
class Probe(_Message):
    """A dropped worker asking whether the coordinator is alive (worker/last_resort.py): it
    proves it knows the secret, says why it came and leaves (logged as a rejected connection)."""

    TYPE: ClassVar[str] = "probe"
    worker: str
    why: str


@dataclass(frozen=True)
class Heartbeat(_Message):
    """``hb``: built by :func:`heartbeat` on the hot path; this class is for tests and tools."""

    TYPE: ClassVar[str] = "hb"
    gen: Optional[int] = None
    step: Optional[int] = None
    training: Optional[bool] = None
    compute_s: Optional[float] = None

    def encode(self) -> Dict[str, Any]:
        return heartbeat(gen=self.gen, step=self.step, training=self.training, compute_s=self.compute_s)


def heartbeat(**fields: Any) -> Dict[str, Any]:
    """The hot path (one per rank per interval): ``{"type": "hb", **fields}`` with the worker's
    ``gen``, ``step``, ``training``, ``compute_s`` (the client adds ``t``). Receivers read
    ``step`` and ``compute_s`` in place; it is never parsed into a class."""
    return {"type": "hb", **fields}


# ============================================================ coordinator -> worker (control)

Endpoint = Tuple[Optional[str], Optional[int]]  # a worker's (host, state port)


@dataclass(frozen=True)
class Config(_Message):
    """The coordinator's answer to a hello: the job's config, its store, its run directory."""

    TYPE: ClassVar[str] = "config"
    job: str
    config: Dict[str, Any]
    store: str
    run_dir: Optional[str] = None
    spare: bool = False


@dataclass(frozen=True)
class Assign(_Message):
    """Rank ``rank`` of generation ``gen`` starts at ``step``; fetch it from ``sources`` if behind.
    ``rank`` None (no ``rank`` field): the worker keeps the rank it was last ready as.
    ``shard``/``holders``/``holds``: a sharded rank's layout (coordinator/sharding.py).
    ``lost``: the ranks of ``0..world-1`` no process holds any more (a job that shrank,
    ``cluster.min_nodes``): the survivors train them too (rundir/numbering.py ``shrunk``).
    ``adopted`` (ZeRO, a job that shrank): lost rank -> ``{"holders", "sources"}`` of its
    shard, which this worker steps too (coordinator/sharding.py)."""

    TYPE: ClassVar[str] = "assign"
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"rank", "shard", "holders", "holds", "load", "lost", "adopted"})
    gen: int
    rank: Optional[int]
    world: int
    step: int
    sources: List[Dict[str, Any]]  # [{"worker", "host", "port"}], at most planner.MAX_SOURCES
    faults_done: List[int]
    shard: Optional[int] = None
    holders: Optional[Any] = None
    holds: Optional[Any] = None
    load: Optional[Dict[str, Any]] = None
    lost: Optional[List[int]] = None
    adopted: Optional[Dict[str, Dict[str, Any]]] = None


def assign(
    gen: int,
    rank: Optional[int],
    world: int,
    step: int,
    sources: Iterable[str],
    endpoints: Mapping[str, Endpoint],
    faults_done: List[int],
    load: Optional[Dict[str, Any]] = None,
    layout: Optional[Dict[str, Any]] = None,
    lost: Sequence[int] = (),
) -> Dict[str, Any]:
    """``Assign(...).encode()`` from the coordinator's view, built as a dict in place: a hot path
    (one per rank of a recovery; a frozen dataclass's construction alone costs 2-4x this). Every
    message a coordinator sends is bounded in size whatever the world size (``sources``: at most
    ``planner.MAX_SOURCES``; ``lost``: at most the ranks of the nodes lost). ``layout``: Assign's
    ``shard``, ``holders``, ``holds``."""
    src = [{"worker": s, "host": endpoints[s][0], "port": endpoints[s][1]} for s in sources]
    msg = {"type": "assign", "gen": gen, "rank": rank, "world": world, "step": step, "sources": src, "faults_done": faults_done, **(layout or {})}
    if rank is None:
        del msg["rank"]
    if load:
        msg["load"] = load
    if lost:
        msg["lost"] = list(lost)
    return msg


@dataclass(frozen=True)
class Abort(_Message):
    """Abandon the in-flight step and answer ``held`` for generation ``gen``. ``at_step`` (a
    planned move, coordinator/moves.py): finish the steps before that one first, abandon none,
    and hold there (a rank already past it holds at its own committed step)."""

    TYPE: ClassVar[str] = "abort"
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"at_step"})
    gen: int
    at_step: Optional[int] = None


@dataclass(frozen=True)
class Stop(_Message):
    """The job is over; ``save``: the path its holder writes the emergency copy to first."""

    TYPE: ClassVar[str] = "stop"
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"save"})
    save: Optional[str] = None


@dataclass(frozen=True)
class FaultAck(_Message):
    """The coordinator recorded fault ``index``: the worker may now fire it."""

    TYPE: ClassVar[str] = "fault_ack"
    index: int


@dataclass(frozen=True)
class Inject(_Message):
    TYPE: ClassVar[str] = "inject"
    index: int


@dataclass(frozen=True)
class CopyAt(_Message):
    """train.save_every_s: make a copy of ``step`` (worker/periodic.py)."""

    TYPE: ClassVar[str] = "copy_at"
    step: int


@dataclass(frozen=True)
class Save(_Message):
    TYPE: ClassVar[str] = "save"
    path: str
    shard: int
    step: int


@dataclass(frozen=True)
class Export(_Message):
    TYPE: ClassVar[str] = "export"
    files: List[str]
    out: str
    step: int


@dataclass(frozen=True)
class Dropped(_Message):
    """Declared failed (or refused): said, then its connection is closed."""

    TYPE: ClassVar[str] = "dropped"
    why: str


# ============================================================ a node's relay <-> coordinator


@dataclass(frozen=True)
class RelayHello(_Message):
    TYPE: ClassVar[str] = "relay"
    node: str
    pid: int
    host: str


@dataclass(frozen=True)
class Up(_Message):
    """Workers' messages in order, ``[[worker, message], ...]`` (relay.py writes its frames as bytes: ``UP_HEAD``)."""

    TYPE: ClassVar[str] = "up"
    m: List[Any]


@dataclass(frozen=True)
class Down(_Message):
    """``[[worker or [workers], message], ...]`` (control/server.py writes its frames as bytes: ``DOWN_HEAD``)."""

    TYPE: ClassVar[str] = "down"
    m: List[Any]


UP_HEAD = b'{"type":"up","m":['
DOWN_HEAD = b'{"type":"down","m":['


@dataclass(frozen=True)
class Gone(_Message):
    """The relay's word that a worker's local connection closed (the process died)."""

    TYPE: ClassVar[str] = "gone"
    why: str


@dataclass(frozen=True)
class HeartbeatSummary(_Message):
    """``hbs``: built by :func:`heartbeat_summary` on the hot path; this class is for tests and tools."""

    TYPE: ClassVar[str] = "hbs"
    t: float
    w: Dict[str, List[Any]]

    def encode(self) -> Dict[str, Any]:
        return heartbeat_summary(self.t, self.w)


def heartbeat_summary(t: float, w: Dict[str, List[Any]]) -> Dict[str, Any]:
    """The hot path (one per node per interval): ``w`` is worker -> [age_s, step, compute_s];
    the coordinator reads it in place (control/server.py ``_on_summary``)."""
    return {"type": "hbs", "t": t, "w": w}


# ============================================================ the handshake of every connection


@dataclass(frozen=True)
class Challenge(_Message):
    TYPE: ClassVar[str] = "challenge"
    nonce: str


@dataclass(frozen=True)
class Auth(_Message):
    TYPE: ClassVar[str] = "auth"
    mac: str
    nonce: str


@dataclass(frozen=True)
class Welcome(_Message):
    TYPE: ClassVar[str] = "welcome"
    mac: str


# ============================================================ a worker's state port (state/transfer.py)


@dataclass(frozen=True)
class Fetch(_Message):
    """Ask a source for the state of (gen, step): ``shard`` when sharded; ``part``/``index``/``of``
    only when not the whole state (``all``, group 0 of 1)."""

    TYPE: ClassVar[str] = "fetch"
    gen: int
    step: int
    shard: Optional[int] = None
    part: str = Part.ALL.value
    index: int = 0
    of: int = 1

    def encode(self) -> Dict[str, Any]:
        msg: Dict[str, Any] = {"type": "fetch", "gen": self.gen, "step": self.step}
        if self.shard is not None:
            msg["shard"] = self.shard
        if (self.part, self.of) != ("all", 1):
            msg.update(part=self.part, index=self.index, of=self.of)
        return msg


@dataclass(frozen=True)
class StateHeader(_Message):
    """The header before a state's raw bytes: ``entries`` [{name, dtype, shape}], ``meta``."""

    TYPE: ClassVar[str] = "state"
    entries: List[Dict[str, Any]]
    meta: Dict[str, Any]


@dataclass(frozen=True)
class End(_Message):
    """The trailer after a state's raw bytes: their checksum."""

    TYPE: ClassVar[str] = "end"
    xxh3_64: str


@dataclass(frozen=True)
class Replica(_Message):
    """A peer pushes a copy of its shard (parallel=zero|fsdp); a StateHeader and bytes follow."""

    TYPE: ClassVar[str] = "replica"
    gen: int
    shard: int
    step: int


@dataclass(frozen=True)
class Ack(_Message):
    TYPE: ClassVar[str] = "ack"
    step: int


@dataclass(frozen=True)
class Refused(_Message):
    TYPE: ClassVar[str] = "refused"
    reason: str


# ============================================================ the rendezvous store (rendezvous.py)


@dataclass(frozen=True)
class StoreRequest(_Message):
    """One store operation (``op``, a StoreOp); only the fields of that operation are sent."""

    TYPE: ClassVar[str] = "store"
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"key", "keys", "value", "amount", "expected", "desired", "timeout_s"})
    op: str
    key: Optional[str] = None
    keys: Optional[List[str]] = None
    value: Optional[str] = None  # base64
    amount: Optional[int] = None
    expected: Optional[str] = None  # base64
    desired: Optional[str] = None  # base64
    timeout_s: Optional[float] = None


class _NoValue:
    """``StoreAnswer.value`` absent (``set``), not None (``wait`` answers ``"value": null``)."""

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()


@dataclass(frozen=True)
class StoreAnswer(_Message):
    TYPE: ClassVar[str] = "store"
    _OMIT: ClassVar[FrozenSet[str]] = frozenset({"error"})
    ok: bool
    value: Any = NO_VALUE
    error: Optional[str] = None

    def encode(self) -> Dict[str, Any]:
        msg: Dict[str, Any] = {"type": "store", "ok": self.ok}
        if self.value is not NO_VALUE:
            msg["value"] = self.value
        if self.error is not None:
            msg["error"] = self.error
        return msg


# ============================================================ registries and parse

Message = Union[
    Built,
    Metrics,
    Eval,
    Held,
    Joining,
    Ready,
    Fetched,
    TransferFailed,
    FaultFired,
    Done,
    Saved,
    SaveFailed,
    LoadFailed,
    NonFinite,
    StartupError,
    WorkerFailed,
    Exported,
    ExportFailed,
    PeriodicSaved,
    PeriodicFailed,
]


def _kinds(*classes: Type[Any]) -> Dict[str, Type[Any]]:
    return {c.TYPE: c for c in classes}


# what the coordinator parses from a connected worker (today's set: hello and hb are read before, in place): the classes of Message
KINDS: Dict[str, Type[Any]] = _kinds(*get_args(Message))
TO_COORDINATOR: Dict[str, Type[Any]] = KINDS
CONNECTING: Dict[str, Type[Any]] = _kinds(Hello, RelayHello, Probe, Heartbeat)  # first words, and the hot path
TO_WORKER: Dict[str, Type[Any]] = _kinds(Config, Assign, Abort, Stop, FaultAck, Inject, CopyAt, Save, Export, Dropped)
RELAY: Dict[str, Type[Any]] = _kinds(RelayHello, Up, Down, Gone, HeartbeatSummary, Dropped)
HANDSHAKE: Dict[str, Type[Any]] = _kinds(Challenge, Auth, Welcome)
STATE_PORT: Dict[str, Type[Any]] = _kinds(Fetch, StateHeader, End, Replica, Ack, Refused)
STORE_REQUESTS: Dict[str, Type[Any]] = _kinds(StoreRequest)
STORE_ANSWERS: Dict[str, Type[Any]] = _kinds(StoreAnswer)

_NUMBER = (int, float)
_CHECKS = {int: _NUMBER, float: _NUMBER, str: (str,)}


def _check(kind: str, name: str, base: Optional[type], value: Any, required: bool) -> Any:
    if value is None:
        if required:
            raise MessageError(f"{kind!r} message: field {name!r} is missing. {HINT_VERSION}")
        return None
    integral = base is not int or not isinstance(value, float) or value.is_integer()
    if base is not None and (not isinstance(value, _CHECKS[base]) or isinstance(value, bool) or not integral):
        raise MessageError(f"{kind!r} message: field {name!r} = {value!r} is not of type {base.__name__}. {HINT_VERSION}")
    return int(value) if base is int and isinstance(value, float) and value.is_integer() else value


Spec = Tuple[str, Optional[type], bool, Any, Tuple[type, ...]]  # field name, its checked type (None: any), required, default, types taken as they are


def _spec(cls: Type[Any]) -> List[Spec]:
    """What ``parse`` checks of each field, worked out once per class (it runs for every message
    of a recovery: held, joining, ready from every rank)."""
    out = []
    for f in fields(cls):
        base = {"int": int, "float": float, "str": str}.get(str(f.type).replace("Optional[", "").rstrip("]"))
        exact = {int: (int,), float: (int, float), str: (str,)}.get(base, ())  # type: ignore[arg-type]
        required = f.default is MISSING and f.default_factory is MISSING and not str(f.type).startswith("Optional[")  # assign's rank: may be absent
        out.append((f.name, base, required, None if f.default is MISSING else f.default, exact))
    return out


_SPECS: Dict[Type[Any], List[Spec]] = {}
_ABSENT = object()


def spec_of(cls: Type[Any]) -> List[Spec]:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _spec(cls)
    return spec


def parse(msg: Dict[str, Any], kinds: Mapping[str, Type[Any]] = KINDS) -> Optional[Any]:
    """The typed message, or None for a kind ``kinds`` does not hold (default: what a coordinator
    parses from its workers). A value of exactly its field's type is taken as it is (the common
    case, checked inline); the rest is checked (and an integral float converted) by ``_check``,
    which also names what is wrong. Keys the class does not know (``t``) are ignored."""
    kind = msg.get("type")
    cls = kinds.get(kind)  # type: ignore[arg-type]
    if cls is None:
        return None
    spec = _SPECS.get(cls) or spec_of(cls)
    args = []
    for name, base, required, default, exact in spec:
        value = msg.get(name, _ABSENT)
        if value is _ABSENT:
            args.append(_check(kind, name, base, None, True) if required else default)  # type: ignore[arg-type]
        elif value is not None and (base is None or type(value) in exact):
            args.append(value)
        else:
            args.append(_check(kind, name, base, value, required))  # type: ignore[arg-type]
    return cls(*args)


ToWorker = Union[Config, Assign, Abort, Stop, FaultAck, Inject, CopyAt, Save, Export, Dropped]


def kind(msg: Mapping[str, Any], kinds: Mapping[str, Type[Any]]) -> Optional[Type[Any]]:
    """The class of ``msg`` in ``kinds`` (None: none there), its fields unchecked: for an end that
    forwards the dict as it is (a relay) or checks its fields itself (the handshake)."""
    return kinds.get(msg.get("type"))  # type: ignore[arg-type]


for _cls in KINDS.values():  # the coordinator's kinds worked out now: the first recovery pays nothing
    spec_of(_cls)
