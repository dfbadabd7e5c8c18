"""A generation's ranks carried out: the assign messages (one shared message for the survivors
that keep their rank, encoded once) and what a re-formed generation leaves in the record
(its recovery, the survivors' continuity: continuity.py). The plan is recovery.py's."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..control import messages
from ..rundir.numbering import trained_by
from ..rundir.restart import shard_copy as _shard_copy
from . import continuity
from .membership import WorkerRec

log = logging.getLogger("ckptless_hpc.coordinator")


class Endpoints:
    """A worker's (host, state port) by id, read on demand: no per-assign copy of all workers."""

    def __init__(self, workers: Dict[str, WorkerRec]) -> None:
        self._w = workers

    def __getitem__(self, wid: str) -> messages.Endpoint:
        w = self._w[wid]
        return w.host, w.state_port


class Reformer:
    def __init__(self, cfg: Any, job: Any, control: Any, launcher: Any, record: Any, telemetry: Any, emit: Callable[..., Any]) -> None:
        self.cfg, self.job, self.control, self.launcher, self.record, self.telemetry, self.emit = cfg, job, control, launcher, record, telemetry, emit

    @property
    def workers(self) -> Dict[str, WorkerRec]:
        return self.job.members.workers

    @property
    def ranks(self) -> Dict[int, str]:
        return self.job.members.ranks

    def assign(self, ranks: Dict[int, str], step: int, sources: Dict[str, List[str]], load: Optional[Dict[str, Any]] = None, adopted: Mapping[int, List[str]] = {}) -> None:
        """Every rank's assign. A survivor that keeps the rank it last said it was ready as, with
        nothing to fetch or load (most of a recovery's ranks), gets one shared message without a
        rank, encoded once (and one entry per node's relay): at 10k ranks, 10k encodings fewer.
        ``adopted`` (ZeRO, a job that shrank): the sources of each lost rank's shard."""
        done, world = sorted(self.job.faults_done), self.job.world
        lost = [r for r in range(world) if r not in ranks] if len(ranks) < world else []  # a shrunk job: the survivors train these too
        ends = Endpoints(self.workers)
        self.job.members.assign(ranks)
        layout = self.job.layout
        trainer = ranks
        steps: Dict[str, List[int]] = {}  # worker -> the lost ranks whose shards it steps
        if layout.sharded:
            trainer = trained_by(ranks, world)
            for v in lost:
                steps.setdefault(trainer[v], []).append(v)
            layout.place({v: self.workers[w].node for v, w in trainer.items()})
        keeping = []
        for r, wid in ranks.items():
            extra = layout.assign_fields(r, trainer, ends, steps.get(wid, ()), adopted)
            if not extra and not load and wid not in sources and self.workers[wid].ready_rank == r:
                keeping.append(wid)
                continue
            shard_load = _shard_copy(load, extra.get("shard"))
            for v, a in extra.get("adopted", {}).items():  # a requeued job that starts shrunk (cluster.start_nodes): the lost ranks' files too
                a["load"] = _shard_copy(load, int(v))
            self.control.send(self.workers[wid], messages.assign(self.job.gen, r, world, step, sources.get(wid, ()), ends, done, shard_load, extra, lost))
        if keeping:
            self.control.broadcast(keeping, messages.assign(self.job.gen, None, world, step, (), ends, done, lost=lost))

    def reformed(self, rec: Any, plan: Any) -> None:
        survivors = self._survivor_continuity(rec)
        (self.record.moves if rec.planned else self.record.recoveries).append(rec)  # a planned move is no recovery (summary.json keeps them apart)
        self.record.degraded.reformed(plan.target_step, rec.t_ready, len(self.ranks), self.job.world)
        self.emit(
            "reformed",
            step=plan.target_step,
            world=self.job.world,
            replacements=rec.replacements,
            bytes=rec.bytes_transferred,
            ranks={str(r): w for r, w in self.ranks.items()},
            at=rec.t_ready,
            survivors=survivors,
        )
        # a job that shrank: spares to grow back with too
        self.telemetry.feed.reformed(rec, len(rec.replacements) + self.job.vacant if self.cfg.cluster.refill_spares else 0)  # refilled once it resumed

    def _survivor_continuity(self, rec: Any) -> Dict[str, Any]:
        """Are the survivors of this recovery the processes launched for them? Measured by the
        launcher, outside the control connection (continuity.py); their identities, for the event."""
        if not self.launcher.measures_identity:  # a launcher that cannot tell (a simulated one)
            return {}
        launched, live = self.launcher.launched_identity, self.launcher.live_identity
        kept = [w for w in self.ranks.values() if w not in rec.replacements.values()]
        now = {w: live(w) for w in kept}
        restarted, unmeasured = continuity.compare({w: launched(w) for w in kept}, now)
        rec.survivors_restarted = len(restarted)
        rec.survivors_checked = len(kept) - len(unmeasured)
        for w, why in restarted.items():
            self.emit("survivor_restarted", self.workers[w], reason=why)
            log.error("survivor %s (rank %s, node %s) is not the process launched for it: %s", w, self.workers[w].rank, self.workers[w].node, why)
        return {w: now[w] for w in kept}
