"""One recovery as a pure state machine: abort -> held -> plan -> assign -> joining/ready -> re-formed.

Driven by the typed messages of the recovering generation (control/messages.py), the failures the
shell detected, and the time it is given; it returns the actions the shell carries out (sends,
events, losses, launcher calls). No sockets, processes or clocks here: the job machine (job.py)
runs it and the shell (shell.py) carries out its actions.

A recovery may take several generations: a failure during it, a survivor that does not hold in
time, a replacement that cannot start (start failures re-plan at once, a worker failing
``max_start_failures`` generations in a row is lost) each begin the next generation of the same
recovery, with the failed ranks of all its generations in one ``metrics.Recovery`` record. A
start that failed because the state sources could not serve it (unreachable, refusing, sending
damaged bytes: the worker names them) counts against those sources, not against the fetcher: a
source failing that often is the one lost.
One exception: the ranks of a node that fail together are one failure. A loss on a node that
this recovery lost already, detected while the survivors are still holding (nothing of the new
generation is planned yet), folds into the generation being held: no new generation, no second
abort (a killed node's workers are seen dying one by one, milliseconds apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from ..config import min_nodes
from ..metrics import Recovery
from ..state.placement import LOST
from ..control.messages import Fetched, Held, Joining, Message, Ready
from .membership import Membership
from .moves import Request
from .planner import Elastic, Plan, plan_recovery, plan_sharded_recovery
from .sharding import Layout, inventories
from .tally import Arrivals

MAX_START_FAILURES = 3  # a worker that cannot start this many generations of one recovery is declared failed

HOLD, BUILD, FORM, REFORMED, GAVE_UP = "hold", "build", "form", "reformed", "gave_up"


@dataclass(frozen=True)
class Options:
    recovery_timeout_s: float  # bound on holding, and on forming a generation
    startup_timeout_s: float  # added when a replacement is still starting
    heartbeat_timeout_s: float
    heartbeat_interval_s: float
    max_start_failures: int = MAX_START_FAILURES
    min_nodes: Optional[int] = None  # cluster.min_nodes below cluster.nodes: with no spare left the job shrinks to no fewer nodes
    world: int = 0  # the job's ranks (cluster.nodes x cluster.workers_per_node): those a shrink leaves without a process are refilled

    @classmethod
    def from_cluster(cls, c: Any) -> "Options":
        m = min_nodes(c)
        elastic = m if m < int(c.nodes) else None
        times = float(c.recovery_timeout_s), float(c.startup_timeout_s), float(c.heartbeat_timeout_s), float(c.heartbeat_interval_s)
        return cls(*times, min_nodes=elastic, world=int(c.nodes) * int(c.workers_per_node))


# ---------------------------------------------------------------- what the shell is told to do
@dataclass(frozen=True)
class NewGeneration:
    gen: int


@dataclass(frozen=True)
class Exclude:
    node: str
    why: str


@dataclass(frozen=True)
class Emit:
    event: str
    worker: Optional[str] = None
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Abort:
    workers: Tuple[str, ...]
    gen: int
    at_step: Optional[int] = None  # a planned move: hold once this step is committed, abandon nothing


@dataclass(frozen=True)
class Release:
    """A planned move is done: these workers (alive, their ranks handed over) stop; their nodes are excluded."""

    workers: Tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Planned:
    """A recovery the job chose (moves.py): the requested nodes' ranks go to spares (none for a
    grow-back) at the boundary ``step``; ``kind``: drain | straggler | grow."""

    kind: str
    reasons: Tuple[str, ...]
    step: int
    lead_s: float = 0.0  # the time the ranks need to reach the boundary (added to the hold's bound)
    requests: Tuple[Request, ...] = ()  # one per node to move: asked again if a failure calls the move off

    @property
    def nodes(self) -> Tuple[str, ...]:
        return tuple(r.node for r in self.requests)


@dataclass(frozen=True)
class Lose:
    worker: str
    why: str


@dataclass(frozen=True)
class Assign:
    ranks: Mapping[int, str]
    step: int
    sources: Mapping[str, List[str]]
    adopted: Mapping[int, List[str]] = field(default_factory=dict)  # ZeRO, a job that shrank: lost rank -> sources of its shard


@dataclass(frozen=True)
class ReleaseCommands:
    """The queued scheduler commands (scancel/scontrol of the failed nodes) may run now."""


@dataclass(frozen=True)
class GiveUp:
    """No plan: no spare left, or a shard lost. The shell saves once and requeues or stops."""

    reason: str
    survivors: Mapping[int, str]
    held_steps: Mapping[str, Optional[int]]
    state_lost: bool


@dataclass(frozen=True)
class Reformed:
    record: Recovery
    plan: Plan


Action = Union[NewGeneration, Exclude, Emit, Abort, Release, Lose, Assign, ReleaseCommands, GiveUp, Reformed]


@dataclass
class _Tally:
    """What the workers said in one generation of the recovery."""

    held: Dict[str, Held] = field(default_factory=dict)
    ready: Set[str] = field(default_factory=set)
    joining: Set[str] = field(default_factory=set)  # holds its state, forming the group
    start_failed: Dict[str, Tuple[str, Tuple[str, ...]]] = field(default_factory=dict)  # could not start it: (why, the sources it blames)
    fetched: List[Fetched] = field(default_factory=list)


class RecoveryMachine:
    """One recovery, from the first failure to the re-formed generation (or giving up).

    ``members`` and ``layout`` are the coordinator's pure membership and layout objects: the
    machine adopts its plan into them. ``doomed``: spares told to fire a fault, never promoted;
    ``fault_times``: when faults that fail a rank fired (the record's ``t_fail``). Both are read
    when needed, so the shell may add to them meanwhile.
    """

    def __init__(
        self,
        members: Membership,
        layout: Layout,
        opts: Options,
        gen: int,
        doomed: Set[str] = frozenset(),
        fault_times: Sequence[float] = (),
        planned: Optional[Planned] = None,  # type: ignore[assignment]
    ) -> None:
        self.members, self.layout, self.opts = members, layout, opts
        self.planned = planned  # a move the job chose: its first generation holds at a boundary, no step aborted
        self.leaving: List[str] = []  # the planned move's workers: they hold and serve their state, then are released
        self._left: Dict[int, str] = {}  # the ranks the move takes, and their leaving workers
        self.fell_back = False  # a failure came during the planned move: this is an ordinary recovery now
        self.gen = gen
        self.doomed, self.fault_times = doomed, fault_times
        self.phase = HOLD
        self.record: Optional[Recovery] = None
        self.plan: Optional[Plan] = None
        self.deadline: Optional[float] = None
        self._failures: Dict[str, Tuple[str, float]] = {}
        self._again = True  # a new generation is due (the first one, or after a timeout / start failure)
        self._tally = _Tally()
        self._survivors: Dict[int, str] = {}
        self._waiting: Any = lambda: False
        self._start_failures: Dict[str, int] = {}  # worker -> generations of this recovery it could not start
        self._limit = 0.0  # the forming phase's bound (for the reason a late worker is given)

    # ---------------------------------------------------------------- inputs
    @property
    def done(self) -> bool:
        return self.phase in (REFORMED, GAVE_UP)

    def on_message(self, worker: str, msg: Message) -> None:
        """A typed message from a worker; only what answers this generation counts."""
        t = self._tally
        if isinstance(msg, Held) and msg.abort_gen == self.gen:
            t.held[worker] = msg
        elif isinstance(msg, Ready) and msg.gen == self.gen:
            t.ready.add(worker)
        elif isinstance(msg, Joining) and msg.gen == self.gen:
            t.joining.add(worker)
        elif isinstance(msg, Fetched) and msg.gen == self.gen:
            t.fetched.append(msg)

    def on_start_failed(self, worker: str, gen: Optional[int], why: str, blame: Sequence[str] = ()) -> None:
        """``worker`` could not start generation ``gen``; ``blame``: the state sources that could not serve it."""
        if gen == self.gen:
            self._tally.start_failed[worker] = (why, tuple(str(w) for w in blame))

    def satisfied(self) -> bool:
        """What the current phase waits for has arrived (cheap: the shell asks after every wake-up)."""
        return self._again or self._waiting()

    def advance(self, now: float, failures: Optional[Mapping[str, Tuple[str, float]]] = None) -> List[Action]:
        """What to do now, given the failures detected since the last call ((reason, detect time)
        by worker). [] when waiting: call again on the next message, failure, or at ``deadline``."""
        if self.done:
            return []
        if failures:
            self._failures.update(failures)
        if self._failures and self._folds():
            return self._fold(now)
        if self.planned is not None and self.record is None and not self._failures and not self.fell_back:
            return self._hold_at_boundary(now)
        if self._failures or self._again:
            return self._bump(now)
        if not self._waiting() and (self.deadline is None or now < self.deadline):
            return []
        if self.phase == HOLD:
            return self._after_hold(now)
        if self.phase == BUILD:  # built, or out of time: assign anyway (a spare that never serves fails its fetchers' start)
            return self._assign(now)
        return self._after_form(now)

    # ---------------------------------------------------------------- phases
    def _bump(self, now: float) -> List[Action]:
        failures, self._failures, self._again = self._failures, {}, False
        workers = self.members.workers
        out: List[Action] = [Exclude(workers[w].node, f"worker {w} failed: {reason}") for w, (reason, _) in failures.items()]
        if self.record is not None:
            self.record.attempts += 1
        if self.planned is not None and not self.fell_back:  # a failure during a planned move: the move is off, the failure recovered from
            self._call_off()
        failed_ranks = self._note(failures, now)
        self.gen += 1
        self._tally = _Tally()
        self._survivors = self.members.survivors()
        held = self._tally.held
        holding = [*self._survivors.values(), *self._leaving_alive()]  # a planned move that failed: its leaving workers still serve
        self._enter(HOLD, Arrivals(holding, held.__contains__), now + self.opts.recovery_timeout_s)
        return out + [
            NewGeneration(self.gen),
            Emit("generation_bumped", None, {"failed_ranks": failed_ranks, "survivors": len(self._survivors)}),
            Abort(tuple(holding), self.gen),
        ]

    def _call_off(self, why: Optional[str] = None) -> None:
        """The planned move is off: its leaving workers keep their ranks, or get them back where
        the incoming spare died (they hold the boundary's state); a rank a live spare already took
        stays moved, its leaving worker serving and then released (the job asks again for the
        moves not done once it trains: job.py). A failure came (``why`` None): an ordinary
        recovery from here, its record the failure's own. No plan for it (``why``: the spare went
        meanwhile): the ranks re-form where they are, at the boundary, and the move's record says why."""
        self.fell_back = True
        m = self.members
        back = {}
        for r, w in self._left.items():  # a rank that its leaving worker still holds, or whose incoming spare died, stays (or goes back)
            holder = m.ranks.get(r)
            if m.workers[w].role == "leaving" and (holder == w or holder is None or m.workers[holder].role == "dead"):
                back[r] = w
        m.ranks = {**m.ranks, **back}
        for w in back.values():
            m.workers[w].role = "active"
        self.leaving = self._leaving_alive()  # the ranks a live spare took: the move stands for them; they serve, then are released
        if why is None:
            self.record = None
        elif self.record is not None:
            self.record.planned = {**(self.record.planned or {}), "called_off": why}
            self.record.failed_ranks, self.record.failed_nodes, self.record.failed_workers = [], [], []

    def _leaving_alive(self) -> List[str]:
        return [w for w in self.leaving if self.members.workers[w].role == "leaving"]

    def _hold_at_boundary(self, now: float) -> List[Action]:
        """A planned move's first generation: every rank (the leaving ones too: they serve their
        state) finishes the steps before the boundary and holds there; nothing is aborted."""
        p = self.planned
        assert p is not None
        self._again = False
        m = self.members
        self.leaving = [w for node in p.nodes for w in m.leave(node)]
        self._left = {r: w for r, w in m.ranks.items() if w in self.leaving}
        moved = sorted(m.workers[w].rank for w in self.leaving)  # type: ignore[type-var]
        self.gen += 1
        self.record = Recovery(
            self.gen,
            moved,
            sorted(p.nodes),
            list(self.leaving),
            list(p.reasons),
            t_fail=now,
            t_detect=now,
            planned={"kind": p.kind, "step": p.step, "reason": "; ".join(p.reasons)},
        )
        self._tally = _Tally()
        self._survivors = m.survivors()
        holding = [*self._survivors.values(), *self.leaving]
        self._enter(HOLD, Arrivals(holding, self._tally.held.__contains__), now + self.opts.recovery_timeout_s + p.lead_s)
        fields = {"kind": p.kind, "step": p.step, "nodes": list(p.nodes), "ranks": moved, "reason": "; ".join(p.reasons)}
        return [NewGeneration(self.gen), Emit("move_planned", None, fields), Abort(tuple(holding), self.gen, at_step=p.step)]

    def _folds(self) -> bool:
        """Are the new failures more of this recovery's lost nodes, seen while the survivors still
        hold (no plan made yet)? Then they are part of the failure being recovered from."""
        if self.phase != HOLD or self._again or self.record is None:
            return False
        workers = self.members.workers
        return all(workers[w].node in self.record.failed_nodes for w in self._failures)

    def _fold(self, now: float) -> List[Action]:
        """The generation being held stays: the lost ones leave the survivors it waits for (the
        deadline is kept), and the plan, when all hold, replaces their ranks too."""
        failures, self._failures = self._failures, {}
        failed_ranks = self._note(failures, now)
        held = self._tally.held
        for w in failures:  # held, then died: nothing it holds is planned with
            held.pop(w, None)
        self._survivors = self.members.survivors()
        self._waiting = Arrivals([*self._survivors.values(), *self._leaving_alive()], held.__contains__)
        nodes = sorted({self.members.workers[w].node for w in failures})
        return [Emit("failure_folded", None, {"failed_ranks": failed_ranks, "nodes": nodes, "survivors": len(self._survivors)})]

    def _note(self, failures: Mapping[str, Tuple[str, float]], now: float) -> List[int]:
        """The record of this recovery (made by its first failures, detected before ``now``)
        takes ``failures`` in; their ranks."""
        workers = self.members.workers
        failed_ranks = sorted(workers[w].rank for w in failures if workers[w].rank is not None)  # type: ignore[type-var]
        rec = self.record
        if rec is None:
            o = self.opts
            t_detect = min([t for _, t in failures.values()], default=now)
            recent = [t for t in self.fault_times if t_detect - o.heartbeat_timeout_s - 2 * o.heartbeat_interval_s <= t <= t_detect]
            rec = self.record = Recovery(self.gen + 1, failed_ranks, [], [], [], t_fail=min(recent, default=t_detect), t_detect=t_detect)
        else:
            rec.failed_ranks = sorted(set(rec.failed_ranks) | set(failed_ranks))
        rec.failed_workers += sorted(failures)
        rec.failed_nodes = sorted({workers[w].node for w in rec.failed_workers})
        rec.reasons += [r for r, _ in failures.values()]
        return failed_ranks

    def _enter(self, phase: str, waiting: Any, deadline: Optional[float]) -> None:
        self.phase, self._waiting, self.deadline = phase, waiting, deadline

    def _again_after(self, out: List[Action]) -> List[Action]:
        """This generation cannot finish: the next one is due (with the losses in ``out``)."""
        self._again = True
        return out

    def _after_hold(self, now: float) -> List[Action]:
        held = self._tally.held
        if not self._waiting():  # timed out
            late = [w for w in [*self._survivors.values(), *self._leaving_alive()] if w not in held]
            why = f"did not hold within cluster.recovery_timeout_s={self.opts.recovery_timeout_s:g}s"
            return self._again_after([Lose(w, why) for w in late])
        held_steps = {w: m.step for w, m in held.items()}
        if self.planned is not None and not self.fell_back and self.record is not None and self.record.attempts == 1:
            self.record.t_fail = self.record.t_detect = now  # a move's downtime starts when the last rank held at the boundary
        plan, reason = self._plan(held_steps)
        if plan is None and self.planned is not None and not self.fell_back and self.leaving:
            self._call_off(reason)  # never give a job up for a move it chose
            plan, reason = self._plan(held_steps)
        if plan is None:
            self.phase = GAVE_UP
            lost = reason.startswith(LOST)
            return [Emit("state_lost" if lost else "no_spare", None, {"reason": reason}), ReleaseCommands(), GiveUp(reason, self._survivors, held_steps, lost)]
        assert self.record is not None
        self.record.target_step = plan.target_step
        self.plan = plan
        before = len(self.members.ranks)
        self.members.adopt(plan)
        out: List[Action] = [Emit("spare_promoted", w, {"rank": r, "step": plan.target_step}) for r, w in plan.promoted.items()]
        if len(plan.ranks) != before:  # shrunk (the survivors train the lost ranks too), or grown back
            nodes = len({self.members.workers[w].node for w in plan.ranks.values()})
            kind = "shrunk" if len(plan.ranks) < before else "grown"
            out.append(Emit(kind, None, {"step": plan.target_step, "ranks": sorted(plan.ranks), "processes": len(plan.ranks), "nodes": nodes, "reason": reason}))
        if self.layout.sharded:  # holders are named by address: a promoted spare must be serving first
            workers = self.members.workers
            self._enter(BUILD, lambda: all(workers[w].built for w in plan.promoted.values()), now + self.opts.startup_timeout_s)
            return out + self.advance(now)
        return out + self._assign(now)

    def _plan(self, held_steps: Mapping[str, Optional[int]]) -> Tuple[Optional[Plan], str]:
        m = self.members
        spares = [sp for sp in m.spares() if sp.worker not in self.doomed]
        elastic = None if self.opts.min_nodes is None else Elastic(self.opts.world, self.opts.min_nodes, {w: m.workers[w].node for w in m.ranks.values()})
        if self.layout.sharded:
            inv = inventories(self._tally.held)
            return plan_sharded_recovery(m.ranks, m.failed(), inv, self.layout.shard_of, spares, m.active_nodes, m.bad_nodes, elastic=elastic, donors=self._leaving_alive())
        return plan_recovery(m.ranks, m.failed(), held_steps, spares, m.active_nodes, m.bad_nodes, elastic=elastic)

    def _assign(self, now: float) -> List[Action]:
        plan = self.plan
        assert plan is not None
        ranks = self.members.ranks
        workers = self.members.workers
        unbuilt = any(not workers[w].built for w in ranks.values())  # a promoted spare still starting needs its start-up time
        limit = self.opts.recovery_timeout_s + (self.opts.startup_timeout_s if unbuilt else 0)
        t = self._tally
        ready = Arrivals(ranks.values(), t.ready.__contains__)
        self._enter(FORM, lambda: bool(t.start_failed) or ready(), now + limit)
        self._limit = limit
        return [Assign(ranks, plan.target_step, plan.sources, plan.adopted), ReleaseCommands()]

    def _blame(self, start_failed: Mapping[str, Tuple[str, Tuple[str, ...]]]) -> List[Action]:
        """Each start failure counts against who caused it: the sources the worker names when
        they could not serve it (it reached the coordinator, so its own network works), else the
        worker; whoever reaches ``max_start_failures`` generations of this recovery is lost."""
        k = self.opts.max_start_failures
        lost: Dict[str, str] = {}
        for w, (why, blame) in start_failed.items():
            sources = [s for s in blame if s in self.members.workers and s != w]
            for culprit in sources or [w]:
                n = self._start_failures[culprit] = self._start_failures.get(culprit, 0) + 1
                if n >= k and culprit not in lost:
                    lost[culprit] = f"could not serve its state to {w} in {k} generations: {why}" if sources else f"could not start {k} generations in a row: {why}"
        return [Lose(w, why) for w, why in lost.items()]

    def _after_form(self, now: float) -> List[Action]:
        t = self._tally
        if t.start_failed:  # plan again at once (other sources, the next copy)
            return self._again_after(self._blame(t.start_failed))
        if not self._waiting():  # timed out: blame only who never got as far as forming the group; if all did, form again
            why = f"did not join generation {self.gen} within {self._limit:.0f}s"
            return self._again_after([Lose(w, why) for w in self.members.ranks.values() if w not in t.joining])
        rec, plan = self.record, self.plan
        assert rec is not None and plan is not None
        self.phase = REFORMED
        rec.gen = self.gen
        rec.t_ready = now
        rec.replacements = {str(r): self.members.ranks[r] for r in rec.failed_ranks if r in self.members.ranks}
        rec.replacements.update({str(r): w for r, w in plan.promoted.items() if r in self.members.ranks})  # a grow-back: ranks no process held
        rec.transfer_s = max([f.seconds for f in t.fetched], default=0.0)
        rec.bytes_transferred = sum(f.bytes for f in t.fetched)
        out: List[Action] = []
        p, leaving = self.planned, self._leaving_alive()
        if p is not None and leaving:  # a planned move: the workers that handed their ranks over stop, their nodes are not used again
            why = f"{p.kind}: " + "; ".join(p.reasons)
            nodes = sorted({self.members.workers[w].node for w in leaving})
            out += [Release(tuple(leaving), why)] + [Exclude(n, f"moved off at step {plan.target_step} ({why})") for n in nodes]
        return out + [Reformed(rec, plan)]  # the last: the job machine leaves the recovery with it
