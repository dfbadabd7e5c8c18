"""Recovery planning: a pure function from (membership, failures, held steps, spares) to a plan.

No processes, sockets or clocks here; the coordinator carries plans out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..rundir.numbering import initial_ranks as initial_ranks, node_order, trained_by  # the numbering rule, below both its users (rundir/numbering.py)


MAX_SOURCES = 4  # state sources named per worker: a few alternatives, never every survivor


@dataclass(frozen=True)
class Spare:
    worker: str
    node: str
    ready: bool  # model built, waiting


@dataclass(frozen=True)
class Elastic:
    """A job that may shrink (``cluster.min_nodes`` < ``cluster.nodes``): ranks ``0..world-1``,
    each worker's node, and the fewest nodes of workers it goes on with."""

    world: int
    min_nodes: int
    node_of: Mapping[str, str]


@dataclass
class Plan:
    target_step: int
    ranks: Dict[int, str]  # rank -> worker after recovery
    promoted: Dict[int, str]  # failed rank -> spare worker
    sources: Dict[str, List[str]] = field(default_factory=dict)  # worker needing state -> source workers, in order
    adopted: Dict[int, List[str]] = field(default_factory=dict)  # ZeRO, a job that shrank: lost rank whose shard its new holder fetches -> sources


def by_node(workers: Iterable[Tuple[str, str]]) -> List[Tuple[str, List[str]]]:
    """(worker, node) pairs grouped by node, nodes in natural order (n2 before n10): one pass."""
    groups: Dict[str, List[str]] = {}
    for wid, node in workers:
        groups.setdefault(node, []).append(wid)
    return [(n, groups[n]) for n in sorted(groups, key=node_order)]


def order_spares(spares: Sequence[Spare], active_nodes: Set[str], bad_nodes: Set[str]) -> List[Spare]:
    """Usable spares, best first: built ones, on nodes already in use (keeps fresh nodes whole), by name."""
    usable = [s for s in spares if s.node not in bad_nodes]
    return sorted(usable, key=lambda s: (not s.ready, s.node not in active_nodes, s.node, s.worker))


def plan_recovery(
    ranks: Mapping[int, str],
    failed: Set[str],
    held: Mapping[str, Optional[int]],
    spares: Sequence[Spare],
    active_nodes: Set[str],
    bad_nodes: Set[str],
    max_sources: int = MAX_SOURCES,
    elastic: Optional[Elastic] = None,
) -> Tuple[Optional[Plan], str]:
    """Replace every failed rank by a spare and pick state sources. Returns (plan or None, reason).

    ``elastic``: a job that may shrink. The ranks to fill are the failed ones and those a
    shrink left without a process (lowest first); what the spares cannot fill stays with the
    survivors (rundir/numbering.py ``shrunk``), while the workers live on at least
    ``min_nodes`` nodes. The plan's ranks are then fewer than ``world``; a recovery with no
    failure grows the job back once a spare is there.

    The target step is the newest step any survivor holds: a survivor can be one step ahead
    when an allreduce completed on part of the ring (its result is valid: every rank
    contributed). Survivors behind it and the promoted spares fetch the state, the sources
    being spread over the survivors that hold the target: at most ``max_sources`` each (the
    first is the one to use, the others are fallbacks), so that an assign stays small at any
    world size.
    """
    survivors = {r: w for r, w in ranks.items() if w not in failed}
    steps = {w: held.get(w) for w in survivors.values()}
    known = {w: s for w, s in steps.items() if s is not None}
    if not known:
        return None, f"no surviving rank holds a committed state (failed: {sorted(failed)})"
    target = max(known.values())
    holders = [w for r, w in sorted(survivors.items()) if known.get(w) == target]
    if elastic is None:
        promoted, why = _promote(ranks, failed, spares, active_nodes, bad_nodes)
        if promoted is None:
            return None, why
        shrunk = ""
    else:
        promoted, shrunk = _promote_elastic(ranks, failed, spares, active_nodes, bad_nodes, elastic)
        if promoted is None:
            return None, shrunk
    new_ranks = dict(survivors)
    new_ranks.update(promoted)
    needing = [w for r, w in sorted(new_ranks.items()) if r in promoted or known.get(w) != target]
    sources = {w: spread_sources(holders, i, max_sources) for i, w in enumerate(needing)}
    reason = f"target step {target}; " + ", ".join([f"rank {r} -> {w}" for r, w in promoted.items()] + ([shrunk] if shrunk else []))
    return Plan(target, dict(sorted(new_ranks.items())), promoted, sources), reason


def _promote(ranks: Mapping[int, str], failed: Set[str], spares: Sequence[Spare], active_nodes: Set[str], bad_nodes: Set[str]) -> Tuple[Optional[Dict[int, str]], str]:
    """Each failed rank -> a usable spare (best first), or (None, why) when too few are left."""
    lost = sorted(r for r, w in ranks.items() if w in failed)
    candidates = order_spares(spares, active_nodes, bad_nodes)
    if len(candidates) < len(lost):
        return None, f"no spare left: {len(lost)} rank(s) {lost} failed and {len(candidates)} usable spare(s) remain"
    return {r: candidates[i].worker for i, r in enumerate(lost)}, ""


def _promote_elastic(
    ranks: Mapping[int, str], failed: Set[str], spares: Sequence[Spare], active_nodes: Set[str], bad_nodes: Set[str], e: Elastic
) -> Tuple[Optional[Dict[int, str]], str]:
    """Each rank without a process (failed, or left by a shrink), lowest first -> a usable spare,
    as far as they go; (promoted, what is left to the survivors) or (None, why) when the workers
    would live on fewer than ``min_nodes`` nodes."""
    lost = sorted({r for r, w in ranks.items() if w in failed} | (set(range(e.world)) - set(ranks)))
    candidates = order_spares(spares, active_nodes, bad_nodes)
    promoted = {r: candidates[i].worker for i, r in enumerate(lost[: len(candidates)])}
    left = lost[len(promoted) :]
    if not left:
        return promoted, ""
    live = [w for w in ranks.values() if w not in failed] + list(promoted.values())
    nodes = {e.node_of[w] for w in ranks.values() if w not in failed} | {s.node for s in candidates[: len(promoted)]}
    if len(nodes) < e.min_nodes:
        return None, f"no spare left: rank(s) {left} have no process and the workers would live on {len(nodes)} node(s), fewer than cluster.min_nodes={e.min_nodes}"
    return promoted, f"no spare left: rank(s) {left} trained by the {len(live)} processes on {len(nodes)} node(s) (cluster.min_nodes={e.min_nodes})"


def spread_sources(holders: Sequence[str], i: int, k: int) -> List[str]:
    """The i-th fetcher's sources: k holders starting at holder i (mod), so load is spread."""
    n = len(holders)
    return [holders[(i + j) % n] for j in range(min(k, n))]


def plan_sharded_recovery(
    ranks: Mapping[int, str],
    failed: Set[str],
    inventories: Mapping[str, Mapping[int, Iterable[int]]],
    shard_of_rank: Mapping[int, int],
    spares: Sequence[Spare],
    active_nodes: Set[str],
    bad_nodes: Set[str],
    max_sources: int = MAX_SOURCES,
    elastic: Optional[Elastic] = None,
    donors: Iterable[str] = (),
) -> Tuple[Optional[Plan], str]:
    """As :func:`plan_recovery`, for sharded state: the target is the newest step at which every
    shard is held by a survivor (its owner's live state or snapshot, a holder's copy, a replica
    of the same shard index); a worker that does not hold its own shard at the target fetches
    it from the workers that do. (None, why) when a shard is lost (owner and holders) or no
    spare is left. ``elastic`` (ZeRO): the ranks no spare fills go to survivors
    (rundir/numbering.py ``trained_by``), each of which steps their shards too, fetched where
    it holds no copy (``Plan.adopted``). ``donors``: workers that give up their ranks alive (a
    planned move's, moves.py): they serve what they hold, their own shard first among it."""
    from ..state.placement import plan_shards

    survivors = {r: w for r, w in ranks.items() if w not in failed}
    if elastic is None:
        promoted, shrunk = _promote(ranks, failed, spares, active_nodes, bad_nodes)
    else:
        promoted, shrunk = _promote_elastic(ranks, failed, spares, active_nodes, bad_nodes, elastic)
    if promoted is None:
        return None, shrunk
    new_ranks = dict(survivors)
    new_ranks.update(promoted)
    alive = {w: inventories.get(w, {}) for w in [*survivors.values(), *donors]}
    world = elastic.world if elastic is not None else len(ranks)
    shards, why = plan_shards(trained_by(new_ranks, world), shard_of_rank, alive, max_sources)
    if shards is None:
        return None, why
    sources = {new_ranks[r]: ws for r, ws in shards.sources.items() if r in new_ranks}
    adopted = {r: ws for r, ws in shards.sources.items() if r not in new_ranks}
    reason = f"target step {shards.target_step} (every shard held); " + ", ".join([f"rank {r} -> {w}" for r, w in promoted.items()] + ([shrunk] if shrunk else []))
    return Plan(shards.target_step, dict(sorted(new_ranks.items())), promoted, sources, adopted), reason
