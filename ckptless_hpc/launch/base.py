"""What the coordinator asks of its launcher: every member it calls, declared once.

A ``typing.Protocol``, not a base class: no launcher inherits a default, so each one (local,
Slurm, and the stand-ins of the tests and benchmarks) spells out what it does for every call,
and ``tests/unit/test_launch_protocol.py`` fails when one lacks a member or takes other
arguments. The coordinator calls these directly, with no ``getattr(launcher, name, default)``.

A launcher with no scheduler to talk to (local processes, the stand-ins) makes ``register``,
``hold_commands``, ``release_commands`` and ``exclude_node`` do nothing; the Slurm launcher
queues its scancel/scontrol behind them (``background.CommandQueue``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Tuple

if TYPE_CHECKING:
    from ..coordinator.continuity import Identity

ExitCallback = Callable[[str, int], None]  # (worker, its exit code as asyncio reports it)


class Launcher(Protocol):
    batch_node: Optional[str]
    """The node the coordinator runs on (Slurm's batch host), written into restart.json; None
    when it runs on no worker node (local runs, the stand-ins)."""

    node_is_one_step: bool
    """True when a node's workers share one scheduler step (Slurm's srun per node): ending one
    worker ends them all, so the coordinator counts the node's ranks as one failure."""

    measures_identity: bool
    """True when ``launched_identity``/``live_identity`` measure real processes from outside the
    control connection (continuity.py); False for a simulated launcher, whose survivors the
    coordinator does not check."""

    async def start_node(self, name: str, workers: int, coordinator: str, on_exit: ExitCallback) -> List[str]:
        """Start ``workers`` workers on node ``name``, connecting to ``coordinator`` (HOST:PORT);
        return their ids (``name.j``). ``on_exit(worker, rc)`` is called when each one's process ends."""
        ...

    def initial_nodes(self, excluded: Any = ()) -> Tuple[List[str], List[str]]:
        """(worker nodes, spare nodes) the job starts on, none of them in ``excluded``. May wait
        for the scheduler: called off the coordinator's event loop."""
        ...

    def free_node(self) -> Optional[str]:
        """A never-used node for a new spare, or None when there is none (or the refill budget is
        spent). May wait for the scheduler: called off the event loop."""
        ...

    def register(self, worker: str, hello: Dict[str, Any]) -> None:
        """A worker connected; ``hello`` is its handshake (node, pid, Slurm step)."""
        ...

    def kill_worker(self, worker: str) -> None:
        """End ``worker``'s process now, never waiting for the scheduler (a scancel is queued)."""
        ...

    def exclude_node(self, node: str, why: str) -> None:
        """Never place anything on ``node`` again (and drain it, where configured and possible)."""
        ...

    def drained_nodes(self, nodes: List[str]) -> List[str]:
        """Those of ``nodes`` an administrator marked to drain (Slurm's DRAIN state): the
        coordinator moves their ranks to spares at a step boundary. [] where no scheduler says so."""
        ...

    def hold_commands(self) -> None:
        """A recovery is being planned: issue no scheduler command until ``release_commands``."""
        ...

    def release_commands(self) -> None:
        """The promotion is sent: issue what was held, in order."""
        ...

    def requeue(self, reason: str) -> Optional[str]:
        """Requeue the job through the scheduler: None when done, else why not (read by the
        coordinator's ending). May wait for the scheduler: called off the event loop."""
        ...

    def log_path(self, worker: str) -> str:
        """The file ``worker``'s stdout and stderr go to (its tail goes into a failure's event)."""
        ...

    def launched_identity(self, worker: str) -> Optional["Identity"]:
        """(pid, start ticks[, step id]) of the process started for ``worker``; None if unknown."""
        ...

    def live_identity(self, worker: str) -> Optional["Identity"]:
        """The same, measured now; None once that process is gone."""
        ...

    async def shutdown(self, timeout_s: float) -> None:
        """The job ended: wait up to ``timeout_s`` for every worker to exit, then kill what is left."""
        ...


def members() -> Dict[str, Any]:
    """The Protocol's members, name -> its function (methods) or its annotation (attributes)."""
    methods = {n: f for n, f in vars(Launcher).items() if callable(f) and not n.startswith("_")}
    return {**{n: Launcher.__annotations__[n] for n in Launcher.__annotations__}, **methods}
