"""The job's lifecycle as a pure machine: STARTING -> TRAINING <-> RECOVERING -> SAVING -> ENDED.

It owns the generation, the failures waiting for a recovery, the requests (save, cancel), the
job's fatal error and non-finite report, the fault bookkeeping, and runs the recovery machine
(recovery.py) inside it. ``advance(now, inputs)`` returns what to do and why, as torchft's
``quorum_compute`` does; the shell (shell.py) carries the actions out (sockets, processes,
files) and tells the machine what happened. No sockets, processes, clocks or sleeps here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..faults import KILLS, spare_fault_due
from .membership import RECOVER, Membership, loss_kind
from .moves import GROW, MoveRules, boundary_step
from .stall import StallWatch
from .recovery import GiveUp, NewGeneration, Options as RecoveryOptions, Planned, RecoveryMachine, Reformed
from .verdicts import EXIT_CANCELLED, EXIT_FAILED, EXIT_STARTUP, startup_timeout


class Phase(enum.Enum):
    STARTING = "starting"
    TRAINING = "training"
    RECOVERING = "recovering"
    SAVING = "saving"
    ENDED = "ended"


@dataclass
class GenState:
    """What ending a job reads of one generation (a recovery's own tallies are in recovery.py)."""

    held: Dict[str, Any] = field(default_factory=dict)
    done: Dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- actions (besides recovery.py's)
@dataclass(frozen=True)
class Finish:
    code: int
    status: str
    error: Optional[str]


@dataclass(frozen=True)
class StartTraining:
    """Generation 0: assign the starters their ranks."""


@dataclass(frozen=True)
class SaveAndRequeue:
    """Save once; requeue where the launcher can, else stop. ``survivors``/``held`` None: hold them all first."""

    reason: str
    survivors: Optional[Dict[int, str]] = None
    held: Optional[Dict[str, Any]] = None
    state_lost: bool = False


@dataclass(frozen=True)
class StopNonfinite:
    nonfinite: Dict[str, Any]


@dataclass(frozen=True)
class Complete:
    """Every rank is done: verify the replicas (and save the final state)."""


@dataclass(frozen=True)
class LeaveRecovery:
    """The recovery is over, whatever its outcome: the queued scheduler commands run."""


@dataclass(frozen=True)
class Inputs:
    """What the shell saw since the last call: start-up's arrivals, a deadline that passed."""

    built: bool = False
    missing: Sequence[str] = ()
    timed_out: bool = False


@dataclass(frozen=True)
class Options:
    startup_timeout_s: float
    refill_spares: bool
    spare_nodes: int
    recovery: RecoveryOptions
    stall_timeout_s: Optional[float] = None  # train.stall_timeout_s (null: from the step time, stall.py)
    total_steps: int = 1 << 62  # train.steps: no move is planned at or past the last step

    @classmethod
    def from_cluster(cls, c: Any, stall_timeout_s: Optional[float] = None, total_steps: int = 1 << 62) -> "Options":
        return cls(float(c.startup_timeout_s), bool(c.refill_spares), int(c.spare_nodes), RecoveryOptions.from_cluster(c), stall_timeout_s, int(total_steps))


class JobMachine:
    def __init__(self, members: Membership, layout: Any, world: int, opts: Options, faults: Sequence[Any] = ()) -> None:
        self.members, self.layout, self.world, self.opts, self.faults = members, layout, world, opts, list(faults)
        self.phase = Phase.STARTING
        self.gen = -1
        self.gens: Dict[int, GenState] = {}
        self.pending: Dict[str, Tuple[str, float]] = {}  # failed worker -> (reason, detect time)
        self.fatal: Optional[str] = None
        self.nonfinite: Optional[Dict[str, Any]] = None  # a rank refused a non-finite step (train.on_nonfinite=stop)
        self.save_requested: Optional[str] = None  # preemption / time limit: save once, then requeue
        self.cancel_requested: Optional[str] = None  # SIGTERM / SIGINT / ckptless-hpc cancel
        self.reform_requested = False
        self.recovery: Optional[RecoveryMachine] = None  # the recovery in progress
        self.faults_done: Set[int] = set()
        self.fault_times: List[float] = []  # kills fired: a recovery's t_fail
        self._injected: Set[int] = set()
        self.doomed: Set[str] = set()  # spares told to fire a fault: never promoted (their death may land late)
        self.stall = StallWatch(opts.stall_timeout_s)  # a job that commits no step while it trains
        self.moves = MoveRules()  # drains and stragglers to hand to spares at a step boundary (moves.py)
        self._move_ready = False  # poll_moves found a grow-back or a move due: attention() reads this, O(1)
        self.step: Optional[int] = None  # the newest committed step heard of (rank 0's metrics), and the step time
        self.step_s: Optional[float] = None

    @property
    def stopping(self) -> bool:
        return self.phase is Phase.ENDED

    def g(self, gen: int) -> GenState:
        return self.gens.setdefault(gen, GenState())

    def all_done(self) -> bool:
        done = self.g(self.gen).done
        return len(done) == len(self.members.ranks) and all(w in done for w in self.members.ranks.values())  # fewer than world once shrunk

    def attention(self) -> bool:
        """Does training need a decision now (a failure, a request, an error, the end)?"""
        return (
            bool(self.pending or self.save_requested or self.cancel_requested or self.nonfinite)
            or self.reform_requested
            or self.fatal is not None
            or self.all_done()
            or self._move_ready
        )

    def poll_moves(self) -> bool:
        """Is a grow-back or a requested move due (a boundary, a built spare)? Asked once per
        heartbeat interval (the shell's judge), not in attention(), which runs after every wake-up:
        it costs O(world) while a move waits for a spare or a shrunk job for its refill."""
        self._move_ready = self.grow_due() or bool(self.moves.wanted and self._moves_due())
        return self._move_ready

    def recovery_settled(self) -> bool:
        """While recovering: can the recovery move on without waiting (new failures, all answered)?"""
        return bool(self.pending) or (self.recovery is not None and self.recovery.satisfied())

    # ---------------------------------------------------------------- the decision
    def advance(self, now: float, inputs: Inputs = Inputs()) -> Tuple[List[Any], str]:
        """What to do now and why. [] with a reason when nothing is to be done yet."""
        if self.phase is Phase.STARTING:
            return self._starting(now, inputs)
        if self.phase is Phase.TRAINING:
            return self._training(now)
        if self.phase is Phase.RECOVERING:
            return self._recovering(now, inputs.timed_out)
        return [], f"{self.phase.value}: the shell carries it out"

    def _end(self, code: int, status: str, error: Optional[str]) -> List[Any]:
        self.phase = Phase.ENDED
        return [Finish(code, status, error)]

    def _starting(self, now: float, inputs: Inputs) -> Tuple[List[Any], str]:
        if self.cancel_requested:
            return self._end(EXIT_CANCELLED, "cancelled", self.cancel_requested), "cancel requested during start-up"
        if self.fatal or not inputs.built:
            self.fatal = self.fatal or startup_timeout(list(inputs.missing), self.opts.startup_timeout_s)
            return self._end(EXIT_STARTUP, "startup_failed", self.fatal), "start-up failed"
        self.gen, self.phase = 0, Phase.TRAINING
        self.stall.start(now)
        return [StartTraining()], "every starter is built"

    def _training(self, now: float) -> Tuple[List[Any], str]:
        if self.cancel_requested:
            return self._end(EXIT_CANCELLED, "cancelled", self.cancel_requested), "cancel requested"
        if self.fatal:
            return self._end(EXIT_FAILED, "failed", self.fatal), "fatal error"
        stalled = None if (self.pending or self.all_done()) else self.stall.overdue(now)
        if stalled:
            self.fatal = stalled
            return self._end(EXIT_FAILED, "stalled", stalled), "no step committed (train.stall_timeout_s)"
        if self.nonfinite and not self.pending:
            self.phase = Phase.SAVING
            return [StopNonfinite(self.nonfinite)], "a non-finite step (train.on_nonfinite)"
        if self.save_requested and not self.all_done():
            self.phase = Phase.SAVING
            return [SaveAndRequeue(self.save_requested)], "save requested (preemption or time limit)"
        if self.pending or self.reform_requested:
            self.phase = Phase.RECOVERING
            self.recovery = RecoveryMachine(self.members, self.layout, self.opts.recovery, self.gen, self.doomed, self.fault_times)
            return self._recovering(now, False)
        planned = self._planned_move() if self._move_ready else None
        self._move_ready = False  # taken, or no longer due: the next poll says again
        if planned is not None:  # a grow-back or a move the job chose: at a step boundary, nothing aborted
            self.phase = Phase.RECOVERING
            self.recovery = RecoveryMachine(self.members, self.layout, self.opts.recovery, self.gen, self.doomed, (), planned)
            return self._recovering(now, False)
        if self.all_done():
            self.phase = Phase.SAVING
            return [Complete()], "every rank is done"
        return [], "training"

    def _recovering(self, now: float, timed_out: bool) -> Tuple[List[Any], str]:
        if self.cancel_requested:  # a cancel never waits for the recovery (it may be stuck on a peer that never answers)
            return self._leave(self._end(EXIT_CANCELLED, "cancelled", self.cancel_requested)), "cancel requested during a recovery"
        if self.fatal:  # a worker's own error (worker_failed): no recovery can cure it
            return self._leave(self._end(EXIT_FAILED, "failed", self.fatal)), "fatal error during a recovery"
        m = self.recovery
        failures, self.pending = self.pending, {}
        out: List[Any] = []
        for a in m.advance(max(now, m.deadline or now) if timed_out else now, failures):
            if isinstance(a, GiveUp):
                self.phase = Phase.SAVING
                return self._leave(out + [SaveAndRequeue(a.reason, dict(a.survivors), dict(a.held_steps), a.state_lost)]), a.reason
            out.append(a)
            if isinstance(a, Reformed):
                self.phase = Phase.TRAINING
                self.stall.start(now)
                return self._leave(out), "re-formed"
        return out, f"recovering ({m.phase})"

    def _leave(self, out: List[Any]) -> List[Any]:
        m, self.recovery = self.recovery, None
        if m is not None and m.fell_back and m.planned is not None:  # a failure called the move off: asked again, for the next boundary
            training = {self.members.workers[w].node for w in self.members.ranks.values()}
            for r in m.planned.requests:
                if r.node in training:  # not a node whose ranks moved all the same
                    self.moves.ask(r.node, r.kind, r.reason, self.members.active_nodes, self.members.bad_nodes)
        return out + [LeaveRecovery()]

    def adopt(self, a: NewGeneration) -> None:
        """The shell carried out a recovery's new generation: it is the job's now."""
        self.gen = a.gen
        self.reform_requested = False  # this generation is the re-forming asked for

    def next_generation(self) -> int:
        """A generation of its own for holding every rank before a save (saving.py): no recovery runs it."""
        self.gen += 1
        return self.gen

    def end(self) -> None:
        self.phase = Phase.ENDED

    # ---------------------------------------------------------------- what happened
    def lost(self, wid: str, was: Optional[str], reason: str, t_detect: float) -> str:
        """A worker is gone: membership.loss_kind's FATAL_AT_STARTUP, RECOVER (a failure for the next recovery) or SPARE_LOST."""
        kind = loss_kind(was, self.phase is not Phase.STARTING)
        if kind == RECOVER:
            self.pending[wid] = (reason, t_detect)
        return kind

    def fail(self, why: str) -> None:
        """The job cannot go on (the first error is the one reported)."""
        self.fatal = self.fatal or why

    def held(self, wid: str, role: str, m: Any) -> Optional[str]:
        """A held message: "abort" (an answer to an abort), "start_failed", "collective_error"
        (a survivor saw a collective fail: re-form after a grace unless explained) or None."""
        if m.abort_gen is not None:
            self.g(m.abort_gen).held[wid] = m
            if self.recovery is not None:
                self.recovery.on_message(wid, m)
            return "abort"
        if str(m.reason).startswith("start failed") and m.gen == self.gen and not self.stopping:
            if self.recovery is not None:
                self.recovery.on_start_failed(wid, m.gen, str(m.reason), m.blame or ())
            return "start_failed"
        if not self.stopping and role == "active" and m.gen == self.gen:
            return "collective_error"
        return None

    def reform_if_unexplained(self, gen: int) -> bool:
        """After the grace of a collective error: nobody known dead, same generation: re-form."""
        if self.gen == gen and not self.pending and not self.stopping:
            self.reform_requested = True
        return self.reform_requested

    def fault_fired(self, index: int, kind: str, t: float) -> None:
        self.faults_done.add(index)
        if kind in KILLS:  # only a fault that fails a rank can be a recovery's t_fail (not a straggler, a spare, the wire)
            self.fault_times.append(t)

    def spare_fault(self, step: int) -> Optional[Tuple[int, str]]:
        """A kill_spare fault due at this step: (its index, the connected spare to fire it); that
        spare is never promoted after."""
        f = spare_fault_due(self.faults, self.faults_done | self._injected, step) if self.faults else None
        spare = None if f is None else self.members.connected_spare()
        if f is None or spare is None:
            return None
        self._injected.add(f.index)
        self.doomed.add(spare.wid)
        return f.index, spare.wid

    def refills(self) -> int:
        """How many spare nodes to start now: ``cluster.spare_nodes`` are kept (counted in nodes),
        and in a job that shrank one more per node's worth of ranks without a process (to grow back)."""
        if self.stopping or not self.opts.refill_spares:
            return 0
        return self.members.spare_nodes_missing(self.opts.spare_nodes + -(-self.vacant // self.members.wpn))

    @property
    def vacant(self) -> int:
        """Ranks no process trains on its own: those a job that shrank dealt to its survivors (0 when whole)."""
        return max(0, self.world - len(self.members.ranks))

    # ---------------------------------------------------------------- planned moves (moves.py)
    def committed(self, step: int, step_s: Optional[float]) -> None:
        """Rank 0 committed ``step`` (its step time, when known): where a move's boundary counts from."""
        if self.step is None or step >= self.step:
            self.step, self.step_s = step, step_s if step_s and step_s > 0 else self.step_s

    def _boundary(self) -> Optional[int]:
        if self.step is None:
            return None
        return boundary_step(self.step, self.step_s, self.opts.total_steps)

    def request_move(self, node: str, kind: str, reason: str) -> Optional[str]:
        """A drain or a straggler to move at the next boundary; a reason when it is refused."""
        if self.stopping:
            return "the job is ending"
        return self.moves.ask(node, kind, reason, self.members.active_nodes, self.members.bad_nodes)

    def _usable_spare_nodes(self) -> int:
        m = self.members
        return len({sp.node for sp in m.spares() if sp.ready and sp.worker not in self.doomed and sp.node not in m.bad_nodes})

    def _moves_due(self) -> list:
        """The requested moves a built spare node can take now (none while a failure waits, in a
        shrunk job, or with the job's end too near for a boundary). O(nodes) when one is asked."""
        if self.phase is not Phase.TRAINING or self.pending or self.vacant or self.all_done() or self._boundary() is None:
            return []
        m = self.members
        on_node: Dict[str, int] = {}
        for w in m.ranks.values():
            rec = m.workers[w]
            if rec.role == "active":
                on_node[rec.node] = on_node.get(rec.node, 0) + 1
        for node in [n for n in self.moves.wanted if on_node.get(n, 0) == 0]:  # its ranks failed meanwhile: a recovery took them
            self.moves.drop(node)
        return self.moves.due(self._usable_spare_nodes(), on_node)

    def _planned_move(self) -> Optional[Planned]:
        """A grow-back due, or the moves due, as one planned recovery at the next boundary."""
        boundary = self._boundary()
        if boundary is None:
            return None
        lead = (boundary - (self.step or 0)) * (self.step_s or 0.0) * 2  # the ranks' time to get there, with room for a slow step
        if self.grow_due():
            return Planned(GROW, (f"{self.vacant} rank(s) without a process of their own and a spare built",), boundary, lead)
        due = self._moves_due()
        if not due:
            return None
        ranks_of: Dict[str, list] = {}
        for r, w in self.members.ranks.items():
            ranks_of.setdefault(self.members.workers[w].node, []).append(r)
        self.moves.taken(due, ranks_of)
        kind = due[0].kind if len({r.kind for r in due}) == 1 else "+".join(sorted({r.kind for r in due}))
        return Planned(kind, tuple(f"node {r.node}: {r.reason}" for r in due), boundary, lead, tuple(due))

    def grow_due(self) -> bool:
        """A job that shrank has a built spare: re-form (with no failure) to hand it ranks back
        (the recovery's plan promotes it, recovery.py). O(1) unless the job is shrunk."""
        if not self.vacant or self.opts.recovery.min_nodes is None or self.phase is not Phase.TRAINING or self.all_done() or self._boundary() is None:
            return False
        return any(sp.ready and sp.worker not in self.doomed and sp.node not in self.members.bad_nodes for sp in self.members.spares())
