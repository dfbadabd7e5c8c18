"""Where this worker stands in the job: its generation, rank and world, the committed step of
the state it holds, whether it trains; and the fields every log line carries (job, generation,
rank, node, step), kept in step with them. One object, read by the worker's collaborators
(peer state, storage copy, faults) instead of each keeping a copy."""

from __future__ import annotations

from typing import Any, Dict, List, Optional


class Standing:
    def __init__(self, node: str) -> None:
        self.ctx: Dict[str, Any] = {"job": "-", "gen": "-", "rank": "spare", "node": node, "step": "-"}
        self.gen = -1
        self.rank: Optional[int] = None
        self.ready_rank: Optional[int] = None  # the rank it last said ready as: a rankless assign keeps it
        self.world = 0
        self.trains: List[int] = []  # the ranks it trains: its own; in a job that shrank, lost ones' too
        self.step: Optional[int] = None  # committed step of the state held; None = no valid state
        # whether that state is the job's: a spare's freshly built model is step 0 of a fresh
        # init, and becomes the job's state only once assigned at step 0, fetched or loaded
        self.holds_job_state = False
        self.training = False
        self.compute_s: Optional[float] = None  # forward+backward time of the last step (straggler detection)

    def join(self, gen: int, rank: int, world: int, trains: Optional[List[int]] = None) -> None:
        self.gen, self.rank, self.world = gen, rank, world
        self.trains = list(trains) if trains else [rank]
        self.ctx.update(gen=gen, rank=rank)

    @property
    def lead(self) -> bool:
        """Whether it trains rank 0, and so reports the job's metrics and evaluations and writes
        the replicated state's periodic copy (rank 0, or its holder in a job that shrank)."""
        return 0 in self.trains

    def at(self, step: int) -> None:
        """The state held is now that of committed step ``step``."""
        self.step = step
        self.ctx["step"] = step

    def lost(self) -> None:
        """No whole state is held any more."""
        self.step = None
        self.ctx["step"] = "-"

    def heartbeat(self) -> Dict[str, Any]:
        return {"gen": self.gen, "step": self.step, "training": self.training, "compute_s": self.compute_s}
