"""What the worker's collaborators need of the engine and of the control connection, declared
as ``typing.Protocol``s (DESIGN.md, "compose, don't mix"): PeerState, StorageCopy, ShardCopies,
Groups and Steps are given a train/engine.Engine and a control/client.ControlClient, and these
name the part of each they use, so that a test can pass a small stand-in instead."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from ..control.messages import Encodable

Entries = List[Tuple[str, Any]]


class Sender(Protocol):
    """The control connection as the collaborators use it: a message class (or its dict) out."""

    def send(self, msg: Any) -> None: ...


class EngineState(Protocol):
    """The engine's state as peers, copies and storage see it (train/engine.py)."""

    mode: str
    state_step: Optional[int]  # the step its tensors hold; None inside an optimizer update

    @property
    def sharded(self) -> bool: ...

    def collect(self, step: int, shard: Optional[int] = None) -> Tuple[Entries, Dict[str, Any]]: ...

    def apply(self, entries: Entries, meta: Dict[str, Any], copy: bool = False, shard: Optional[int] = None) -> None: ...

    def apply_first(self, entries: Entries, meta: Dict[str, Any]) -> None: ...

    def apply_rest(self, entries: Entries, meta: Dict[str, Any]) -> None: ...

    user_view: Any  # state/views.UserView: what a user takes away of this model

    def build_model(self) -> Any: ...


class EngineGroups(Protocol):
    """The engine as a generation's group concerns it (worker/groups.py)."""

    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None: ...

    def let_go(self, comm: Any) -> bool: ...


class EngineSteps(EngineState, Protocol):
    """The engine as a generation's steps drive it (worker/steps.py)."""

    skipped: Dict[str, int]

    def step(self, step: int, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> Any: ...

    def evaluate(self, step: int, wait: Callable[[List[Any]], None], before_reduce: Callable[[], None] = ...) -> Dict[str, float]: ...


__all__ = ["Encodable", "EngineGroups", "EngineState", "EngineSteps", "Sender"]
