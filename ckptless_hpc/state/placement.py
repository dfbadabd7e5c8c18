"""Where sharded state lives, and from where it comes back: pure functions, no I/O.

Vocabulary (docs/sharding.md):

- a *shard* is the unique state of one rank's slice of the model: for ``zero`` and ``fsdp`` rank
  r owns shard r; for ``hsdp`` the ranks with the same index in their shard group hold the same
  shard (``r % shard_size``), so the replicas are its copies and no copy is ever sent;
- a *holder* of rank r's shard (``zero``/``fsdp``) is a rank that receives a copy of it after
  each replicated step: ``replication.factor`` holders, each on a node that is neither the
  owner's nor another holder's (:func:`place`);
- an *inventory* is what one worker can serve: shard id -> the steps it holds it at (its live
  state, its own snapshots, the copies it holds for peers).

A recovery resumes at the newest step at which every shard is held by some survivor
(:func:`plan_shards`): this closes the consistency window of sharded state (PARALLEL.md), since
each rank keeps its own previous snapshot until every rank's copy of a newer step exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

SHARDED = ("zero", "fsdp", "hsdp", "tp", "pp")
LOST = "state lost: "  # the prefix of a plan's reason when some shard is held by nobody
REPLICATED_BY_COPIES = ("zero", "fsdp")  # unique per-rank state: copies are sent to holders
REPLICA_GROUPS = ("hsdp", "tp", "pp")  # groups of ``shard_size`` ranks, each a replica: the same index in every group holds the same shard


def sends_copies(mode: str, world: int, group: Optional[int]) -> bool:
    """Whether each rank's shard is copied to holders on other nodes: zero and fsdp always; tp
    and pp when the job is one replica (no other replica holds a coordinate's shard)."""
    return mode in REPLICATED_BY_COPIES or (mode in ("tp", "pp") and group is not None and int(group) == world)


def node_order(name: str) -> tuple:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1, name)


def shard_of(mode: str, rank: int, shard_size: Optional[int]) -> int:
    """The shard id rank ``rank`` holds (its own number, or its index in its hsdp shard group, tp
    group or pipeline: its stage)."""
    if mode in REPLICA_GROUPS:
        return rank % int(shard_size or 1)
    return rank


def shard_map(mode: str, world: int, shard_size: Optional[int]) -> Dict[int, int]:
    return {r: shard_of(mode, r, shard_size) for r in range(world)}


def place(rank_node: Mapping[int, str], factor: int, previous: Optional[Mapping[int, Sequence[int]]] = None) -> Dict[int, List[int]]:
    """Holders of each owner rank's shard: ``factor`` ranks on distinct nodes other than the
    owner's, ring-wise over the nodes (the owner's node, then the next ones in node order), the
    holder on each node taken at the owner's position on its own node, so load is spread.

    ``previous`` (the placement before a membership change) is kept wherever it is still valid
    (the holder is on another node than the owner and than the other holders): a change moves
    only the copies it has to. Fewer than ``factor`` holders are returned where the nodes do not
    allow more (see :func:`tolerance`)."""
    if factor <= 0:
        return {r: [] for r in rank_node}
    nodes = sorted(set(rank_node.values()), key=node_order)
    on_node: Dict[str, List[int]] = {n: [] for n in nodes}
    for r in sorted(rank_node):
        on_node[rank_node[r]].append(r)
    out: Dict[int, List[int]] = {}
    for owner in sorted(rank_node):
        home = rank_node[owner]
        chosen: List[int] = []
        used = {home}
        for h in (previous or {}).get(owner, ()):
            if len(chosen) < factor and h in rank_node and h != owner and rank_node[h] not in used:
                chosen.append(h)
                used.add(rank_node[h])
        pos = on_node[home].index(owner)
        i = nodes.index(home)
        for k in range(1, len(nodes)):
            if len(chosen) >= factor:
                break
            n = nodes[(i + k) % len(nodes)]
            if n in used:
                continue
            chosen.append(on_node[n][pos % len(on_node[n])])
            used.add(n)
        out[owner] = chosen
    return out


def moved(before: Mapping[int, Sequence[int]], after: Mapping[int, Sequence[int]]) -> int:
    """How many (owner, holder) copies a placement change creates."""
    return sum(len(set(after[o]) - set(before.get(o, ()))) for o in after)


def tolerance(rank_node: Mapping[int, str], holders: Mapping[int, Sequence[int]]) -> int:
    """Simultaneous node losses the layout survives: the fewest distinct nodes holding any
    shard (owner's included), minus one."""
    worst = min((len({rank_node[o]} | {rank_node[h] for h in holders.get(o, ())}) for o in rank_node), default=1)
    return worst - 1


def hsdp_tolerance(world: int, workers_per_node: int, shard_size: int) -> int:
    """Node losses an hsdp layout survives (ranks numbered node by node): the fewest distinct
    nodes holding the replicas of one shard index, minus one."""
    worst = min(len({(i + g * shard_size) // workers_per_node for g in range(world // shard_size)}) for i in range(shard_size))
    return worst - 1


def layout_tolerance(mode: str, world: int, workers_per_node: int, factor: int, shard_size: Optional[int]) -> int:
    """What the config promises, computed at start (ranks numbered node by node)."""
    if mode == "ddp":
        return world // workers_per_node - 1  # every replica holds everything
    if mode in REPLICA_GROUPS and not sends_copies(mode, world, shard_size):
        return hsdp_tolerance(world, workers_per_node, int(shard_size or 1))
    rank_node = {r: f"n{r // workers_per_node}" for r in range(world)}
    return tolerance(rank_node, place(rank_node, factor))


Inventory = Mapping[int, Iterable[int]]  # shard id -> steps held


@dataclass
class ShardPlan:
    target_step: int
    sources: Dict[int, List[str]] = field(default_factory=dict)  # rank needing its shard at target -> workers holding it
    holders_at_target: Dict[int, List[str]] = field(default_factory=dict)  # shard id -> workers


def plan_shards(ranks: Mapping[int, str], shard_of_rank: Mapping[int, int], inventories: Mapping[str, Inventory], max_sources: int = 4) -> Tuple[Optional[ShardPlan], str]:
    """The newest step at which every shard is held by a surviving worker, and for every rank
    whose worker does not hold its own shard at that step, the workers to fetch it from
    (spread: the i-th fetcher starts at the i-th holder). ``inventories`` holds the survivors
    only; a promoted spare has none. (None, why) when some shard is held by nobody."""
    held: Dict[int, Dict[int, List[str]]] = {}  # shard -> step -> workers
    for w in sorted(inventories):
        for shard, steps in inventories[w].items():
            for s in steps:
                held.setdefault(int(shard), {}).setdefault(int(s), []).append(w)
    needed = sorted(set(shard_of_rank.values()))
    common: Optional[Set[int]] = None
    for shard in needed:
        steps = set(held.get(shard, {}))
        common = steps if common is None else common & steps
    if not common:
        lost = [s for s in needed if not held.get(s)]
        owners = {s: sorted(r for r, sh in shard_of_rank.items() if sh == s) for s in lost}
        if lost:
            return None, LOST + "shard(s) held by no survivor (owner and every holder lost): " + ", ".join(f"shard {s} (rank(s) {owners[s]})" for s in lost)
        return None, LOST + "no step at which every shard is held: " + ", ".join(f"shard {s} at {sorted(held[s])}" for s in needed)
    target = max(common)
    plan = ShardPlan(target, holders_at_target={s: held[s][target] for s in needed})
    fetchers = 0
    for r in sorted(ranks):
        shard = shard_of_rank[r]
        w = ranks[r]
        if target in set(int(s) for s in inventories.get(w, {}).get(shard, ())):
            continue  # restores from what it holds itself
        hs = plan.holders_at_target[shard]
        plan.sources[r] = [hs[(fetchers + j) % len(hs)] for j in range(min(max_sources, len(hs)))]
        fetchers += 1
    return plan, f"target step {target} (the newest step at which every shard is held)"
