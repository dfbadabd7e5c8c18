"""Helpers for coordinator unit tests: a composed config and a coordinator with no launcher work."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from hydra import compose, initialize_config_module

from ckptless_hpc.config import register_configs
from ckptless_hpc.coordinator.job import Inputs, Phase
from ckptless_hpc.coordinator.membership import Membership
from ckptless_hpc.coordinator.planner import by_node, initial_ranks

register_configs()


def cfg(*overrides: str) -> Any:
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def membership(nodes: int, wpn: int, spare_nodes: int) -> Membership:
    """Nodes n0.. training (ranks numbered node by node), spare nodes s0.., every worker built."""
    m = Membership(wpn)
    for i in range(nodes):
        m.add_node(f"n{i}", "active")
    for i in range(spare_nodes):
        m.add_node(f"s{i}", "spare")
    for w in m.workers.values():
        w.built = True
    m.ranks = initial_ranks(by_node((w.wid, w.node) for w in m.workers.values() if w.role == "active"))
    m.assign(m.ranks)
    m.active_nodes = {f"n{i}" for i in range(nodes)}
    return m


class NoLauncher:
    """Starts nothing; records what the coordinator asked for (pure-logic tests only). Every
    member of ``ckptless_hpc.launch.base.Launcher`` (test_launch_protocol.py checks it)."""

    batch_node: Optional[str] = None
    node_is_one_step = False
    measures_identity = False  # no process: survivors are not checked

    def __init__(self) -> None:
        self.killed: List[str] = []

    async def start_node(self, name: str, workers: int, coordinator: str, on_exit: Any) -> List[str]:
        return [f"{name}.{j}" for j in range(workers)]

    def initial_nodes(self, excluded: Any = ()) -> Tuple[List[str], List[str]]:
        return [], []

    def free_node(self) -> Optional[str]:
        return None

    def register(self, worker: str, hello: Dict[str, Any]) -> None:
        pass

    def kill_worker(self, worker: str) -> None:
        self.killed.append(worker)

    def exclude_node(self, node: str, why: str) -> None:
        pass

    def drained_nodes(self, nodes: List[str]) -> List[str]:
        return []

    def hold_commands(self) -> None:
        pass

    def release_commands(self) -> None:
        pass

    def requeue(self, reason: str) -> Optional[str]:
        return "the tests' launcher has no scheduler"

    def log_path(self, worker: str) -> str:
        return "/nonexistent"

    def launched_identity(self, worker: str) -> None:
        return None

    def live_identity(self, worker: str) -> None:
        return None

    async def shutdown(self, timeout_s: float) -> None:
        pass


class FakeWriter:
    """Collects frames as bytes (pure-logic tests only)."""

    def __init__(self) -> None:
        self.frames: List[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str) -> None:
        return None


def training(c: Any, gen: int, t_train: float) -> None:
    """A coordinator whose job is training in generation ``gen`` since ``t_train``, without starting it."""
    c.job.gen, c.job.phase, c.record.t_train = gen, Phase.TRAINING, t_train


async def recover(c: Any) -> Any:
    """One recovery, carried out as the shell's loop does: None once re-formed, else the exit code."""
    code = await c._execute(c.job.advance(c.clock())[0], [])
    while code is None and c.job.phase is Phase.RECOVERING:
        code = await c._execute(c.job.advance(c.clock(), Inputs(timed_out=await c._wait()))[0], [])
    return code


def carry_out(job: Any, acts: List[Any]) -> None:
    """The shell's part a pure job-machine test needs: a new generation adopted, assigns taking
    the ranks, a planned move's released workers dead to the job."""
    for a in acts:
        name = type(a).__name__
        if name == "NewGeneration":
            job.adopt(a)
        elif name == "Assign":
            job.members.assign(dict(a.ranks))
        elif name == "Release":
            job.members.release(list(a.workers))
