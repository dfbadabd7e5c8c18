"""The coordinator's view of the state layout (parallel=ddp|zero|fsdp|hsdp|tp|pp): which shard each
rank holds, where its copies go, what the layout survives, and how the final state's
fingerprint is made of the shards'. Pure decisions (state.placement) plus the bits of the
assign message they produce; no I/O."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..config import group_size
from ..state.placement import layout_tolerance, place, sends_copies, shard_map, tolerance


class Layout:
    def __init__(self, cfg: Any) -> None:
        c = cfg.cluster
        p = cfg.get("parallel") if hasattr(cfg, "get") else getattr(cfg, "parallel", None)
        self.mode = str(p.mode) if p is not None else "ddp"
        self.world = c.nodes * c.workers_per_node
        self.wpn = c.workers_per_node
        self.shard_size = group_size(p) if p is not None else None
        self.pp, self.tp = (int(p.get("pp") or 1), int(p.get("tp") or 1)) if p is not None and self.mode == "pp" else (1, 1)
        self.tp_shard = int(p.get("shard_size") or 1) if p is not None and self.mode == "tp" else 1  # FSDP2 over this many TP groups of a replica
        self.pp_shard = int(p.get("shard_size") or 1) if p is not None and self.mode == "pp" else 1  # FSDP2 over this many pipelines of a replica
        r = cfg.get("replication") if hasattr(cfg, "get") else getattr(cfg, "replication", None)
        self.factor = int(r.factor) if r is not None and sends_copies(self.mode, self.world, self.shard_size) else 0
        self.every = int(r.every) if r is not None else 1
        self.shard_of: Dict[int, int] = shard_map(self.mode, self.world, self.shard_size) if self.sharded else {}
        self.placement: Dict[int, List[int]] = {}

    @property
    def sharded(self) -> bool:
        return self.mode != "ddp"

    @property
    def shards(self) -> int:
        """Pieces of the state: 1 (replicated) or one per shard."""
        return len(set(self.shard_of.values())) if self.sharded else 1

    def survives(self) -> int:
        """Simultaneous node losses the configured layout survives (ranks numbered node by node)."""
        return layout_tolerance(self.mode, self.world, self.wpn, self.factor, self.shard_size)

    def describe(self) -> str:
        n = self.survives()
        reps = self.world // int(self.shard_size or 1)
        replicas = f"{reps} replica{'s' if reps != 1 else ''}"
        what = {
            "ddp": "every rank holds the whole state",
            "zero": f"optimizer state sharded over {self.world} ranks, {self.factor} cop{'y' if self.factor == 1 else 'ies'} of each shard on other nodes every {self.every} step(s)",
            "fsdp": f"parameters and optimizer state sharded over {self.world} ranks (FSDP2), {self.factor} cop{'y' if self.factor == 1 else 'ies'} of each shard on other nodes every {self.every} step(s)",
            "hsdp": f"FSDP2 in shard groups of {self.shard_size}, {replicas} of each shard",
            "tp": (
                f"FSDP2 over {self.tp_shard} x tensor parallel {int(self.shard_size or 1) // self.tp_shard}, {replicas} of each (shard, TP rank)'s shard"
                if self.tp_shard > 1
                else f"tensor parallel in groups of {self.shard_size}, {replicas} of each TP coordinate's shard"
            ),
            "pp": (
                f"FSDP2 over {self.pp_shard} pipelines of {self.pp} stages{f' x tensor parallel {self.tp}' if self.tp > 1 else ''} (each stage sharded over "
                f"the pipelines' ranks of it), {replicas} of each (pipeline, stage{', TP rank' if self.tp > 1 else ''})'s shard"
                if self.pp_shard > 1
                else f"pipelines of {self.pp} stages{f' x tensor parallel {self.tp}' if self.tp > 1 else ''}, {replicas} of each "
                + ("(stage, TP rank)'s shard" if self.tp > 1 else "stage's shard")
            ),
        }[self.mode]
        if self.mode in ("tp", "pp") and self.factor:
            what += f", {self.factor} cop{'y' if self.factor == 1 else 'ies'} of each rank's shard on other nodes every {self.every} step(s)"
        tail = "a lost shard ends the job on the last-resort path" if n < 1 else f"survives {n} simultaneous node loss{'es' if n != 1 else ''}"
        return f"parallel={self.mode}: {what}; {tail}"

    def place(self, rank_node: Mapping[int, str]) -> Dict[int, List[int]]:
        """(Re)compute where copies go for the current rank -> node map, keeping what stays valid."""
        if self.factor > 0:
            self.placement = place(rank_node, self.factor, self.placement or None)
        return self.placement

    def live_tolerance(self, rank_node: Mapping[int, str]) -> int:
        return tolerance(rank_node, self.placement) if self.factor > 0 else 0

    def assign_fields(self, rank: int, ranks: Mapping[int, str], endpoints: Any, adopted: Sequence[int] = (), sources: Mapping[int, Sequence[str]] = {}) -> Dict[str, Any]:
        """What a sharded rank's assign carries: its shard, its holders, and the shards it holds
        copies of. ``ranks``: every rank -> the worker that trains it; ``adopted``: the lost
        ranks this one trains too (ZeRO, a job that shrank), whose shards it steps: each with
        its holders and, where it holds no copy, the ``sources`` to fetch it from."""
        if not self.sharded:
            return {}

        def at(workers: Iterable[str]) -> List[Dict[str, Any]]:
            return [{"worker": w, "host": endpoints[w][0], "port": endpoints[w][1]} for w in workers]

        trains = {rank, *adopted}
        holds = sorted({self.shard_of[o] for o, hs in self.placement.items() if trains.intersection(hs)})
        out: Dict[str, Any] = {"shard": self.shard_of[rank], "holders": at(ranks[h] for h in self.placement.get(rank, [])), "holds": holds}
        if adopted:
            out["adopted"] = {str(v): {"holders": at(ranks[h] for h in self.placement.get(v, [])), "sources": at(sources.get(v, ()))} for v in adopted}
        return out

    def final_sha(self, done: Mapping[str, Any], rank_of: Mapping[str, int]) -> Tuple[Optional[str], Optional[str]]:
        """The job's fingerprint from the ranks' done messages: ddp, the one hash every replica
        has; sharded, a hash of each shard's hash in shard order (replicas of a shard must agree)."""
        if not self.sharded:
            hashes = {m.sha256 for m in done.values()}
            if len(hashes) != 1:
                return None, "replicas diverged: state hashes by rank " + str({rank_of[w]: m.sha256[:12] for w, m in done.items()})
            return next(iter(hashes)), None
        by_shard: Dict[int, set] = {}
        for w, m in done.items():
            own = self.shard_of[rank_of[w]] if m.shard is None else int(m.shard)
            for shard, sha in [(own, m.sha256), *((int(k), v) for k, v in (getattr(m, "adopted", None) or {}).items())]:
                by_shard.setdefault(shard, set()).add(sha)
        split = {s: sorted(h)[:2] for s, h in by_shard.items() if len(h) != 1}
        if split:
            return None, f"replicas of a shard diverged: {split}"
        h = hashlib.sha256()
        for s in sorted(by_shard):
            h.update(f"{s}:{next(iter(by_shard[s]))};".encode())
        return h.hexdigest(), None


def inventories(held: Mapping[str, Any]) -> Dict[int, Any]:
    """The survivors' shard inventories (worker -> shard id -> steps), from their held messages."""
    return {w: {int(k): [int(s) for s in v] for k, v in (m.inventory or {}).items()} for w, m in held.items()}
