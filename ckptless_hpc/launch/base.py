"""What every launcher gives the coordinator, with the defaults of a launcher that has no
scheduler to talk to (local processes, the benchmarks' and tests' launchers): noting a worker,
holding and releasing scheduler commands, excluding a node all do nothing. The Slurm launcher
overrides them."""

from __future__ import annotations

from typing import Any, Dict, Optional


class Launcher:
    batch_node: Optional[str] = None  # the node the coordinator runs on (None: on no worker node)
    node_is_one_step: bool = False  # a node's workers share one scheduler step: ending one worker ends them all

    def register(self, worker: str, hello: Dict[str, Any]) -> None:
        """A worker connected (its hello: node, pid, Slurm step)."""

    def hold_commands(self) -> None:
        """A recovery is being planned: issue no scheduler command until ``release_commands``."""

    def release_commands(self) -> None:
        """The promotion is sent: issue what was held, in order."""

    def exclude_node(self, node: str, why: str) -> None:
        """Never place anything on ``node`` again."""
