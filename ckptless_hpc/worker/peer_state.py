"""The worker's side of peer-to-peer state: getting a step's state it does not hold, and serving
the state it holds.

Getting it (state/fetch.py): disjoint groups from several of the sources the coordinator named,
at once, each verified before use; a damaged or missing group is fetched again from another.
Parameters first (``cluster.params_first``, the replicated state): only what the first step's
forward and backward need (parameters, buffers, the task's tensors, the scalars) is fetched
before the group forms; the optimizer state follows behind that step (``Behind``), and the
step's last collective waits for it (``land_behind``). Until it is in, this process holds no
whole state: a step that fails first leaves it holding none (``drop_behind``), and it is
fetched again.

Serving it: the whole state while not training; the optimizer state of step s also while the
step s is trained, up to this rank's own optimizer update (``serves_behind``), which cannot
start before every rank fetching it has it: their last collective of the step comes after.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional

from .. import faults as faultlib
from ..control.messages import Fetched, TransferFailed
from ..state.fetch import Behind, Source, fetch
from ..state.transfer import Arena, StaleState, TransferError, Want
from .injector import FaultInjector
from .interrupt import Aborted, CollectiveError, Waiter
from .seams import EngineState, Sender
from .shard_copies import ShardCopies
from .standing import Standing

log = logging.getLogger("ckptless_hpc.worker")


class PeerState:
    """The state this process gets from peers and serves them; ``behind`` while the optimizer
    state still arrives behind the first step. What it reads of the worker (its standing, its
    waits, its faults, its shard copies) is passed in."""

    def __init__(
        self, cfg: Any, engine: EngineState, shards: Optional[ShardCopies], secret: str, client: Sender, waiter: Waiter, faults: FaultInjector, standing: Standing, node: str
    ) -> None:
        self.cluster, self.engine, self.shards, self.secret, self.client = cfg.cluster, engine, shards, secret, client
        self.waiter, self.faults, self.standing, self.node = waiter, faults, standing, node
        self.behind: Optional[Behind] = None  # parameters first: the optimizer state still arriving behind the first step
        self._behind_t0: Optional[float] = None  # when that step started
        self.arena: Optional[Arena] = None  # a spare's pre-faulted memory to receive its state into

    def held_step(self) -> Optional[int]:
        """The committed step of the job's state this process holds; None when it holds none (a
        spare that never received it, or one whose optimizer state is still arriving behind its first
        step): such a process is never a source, nor saved."""
        s = self.standing
        return s.step if s.holds_job_state and self.behind is None else None

    def fetch(self, sources: List[Dict[str, Any]], gen: int, target: int, timeout_s: float, adopted: Optional[int] = None) -> None:
        """The state of ``target`` from the sources named, in disjoint groups from several at once
        (state/fetch.py), each verified; a damaged or missing group is fetched again. Parameters
        first (``cluster.params_first``, the replicated state): only what the first step's forward
        and backward need is fetched now, the optimizer state follows behind that step.
        ``adopted``: a lost rank's shard this process steps in a job that shrank (ZeRO)."""
        srcs = [Source.of(s) for s in sources]
        split = bool(self.cluster.params_first) and not self.engine.sharded
        shard = adopted if adopted is not None else self.shards.shard if self.shards is not None else None
        want = Want(gen, target, shard, "first" if split else "all")
        arena, self.arena = self.arena, None  # its memory comes to hold (part of) the optimizer state
        if arena is not None:
            arena.offset = 0
        parallel = int(self.cluster.fetch_parallel)
        got = self.waiter.run(
            lambda: fetch(srcs, self.secret, want, timeout_s, arena, parallel, self._transfer_failed(gen), lambda: self.faults.fire_due("receive", target)),
            gen,
            timeout_s,
            "fetch-state",
        )
        t0 = time.monotonic()
        if adopted is not None:
            self.engine.apply(got.received.entries, got.received.meta, shard=adopted)
            self.shards.loaded(adopted)
        else:
            (self.engine.apply_first if split else self.engine.apply)(got.received.entries, got.received.meta)
            self.standing.at(target)
        self.client.send(Fetched(gen, ",".join(got.by_source), got.received.nbytes, got.received.seconds, time.monotonic() - t0))
        log.info(
            "received %s: %.1f MB at step %d from %s in %.3fs (checksum ok)", want.describe(), got.received.nbytes / 1e6, target, _by_source(got.by_source), got.received.seconds
        )
        if split:
            rest = Want(gen, target, None, "rest")
            self.behind = Behind(lambda: fetch(srcs, self.secret, rest, timeout_s, arena, parallel, self._transfer_failed(gen)))
            self.behind.on_done = self.waiter.wake.set

    def _transfer_failed(self, gen: int) -> Callable[[Source, Want, TransferError], None]:
        def report(src: Source, want: Want, e: TransferError) -> None:
            what = want.describe()
            if want.part == "rest" and self._behind_t0 is not None:
                what += f", received behind step {want.step} (started {time.monotonic() - self._behind_t0:.3f}s before)"
            log.warning("state fetch from %s failed: %s: %s", src.worker, what, e)
            self.client.send(TransferFailed(gen, src.worker, f"{what}: {e}"))

        return report

    def start_behind(self, step: int) -> None:
        """The first step after a parameters-first fetch starts: the optimizer state follows."""
        assert self.behind is not None
        self._behind_t0 = time.monotonic()
        self.behind.start()
        log.info("step %d started on the parameters; the optimizer state follows behind its forward and backward", step)

    def land_behind(self, gen: int, step: int) -> None:
        """Before the step's last collective (so that no source can start its optimizer update,
        and change what it serves, before this rank holds it): the optimizer state fetched behind
        the step, verified, loaded."""
        behind = self.behind
        assert behind is not None and behind.t_start is not None
        t_wait = time.monotonic()
        outcome = self.waiter.wait_until(lambda: behind.done, gen, self.cluster.recovery_timeout_s)
        if outcome == "abort":
            raise Aborted("optimizer state")
        if outcome == "timeout":
            raise CollectiveError(f"the optimizer state of step {step} did not arrive within {self.cluster.recovery_timeout_s}s")
        try:
            got = behind.result()
        except TransferError as e:
            raise CollectiveError(f"the optimizer state of step {step} could not be fetched: {e}") from None
        self.engine.apply_rest(got.received.entries, got.received.meta)
        self.behind = None
        assert behind.t_done is not None
        log.info(
            "received optimizer state: %.1f MB at step %d from %s in %.3fs behind the step (arrived %.3fs after the step started; the step waited %.3fs for it; checksum ok)",
            got.received.nbytes / 1e6,
            step,
            _by_source(got.by_source),
            got.received.seconds,
            behind.t_done - behind.t_start,
            max(0.0, behind.t_done - t_wait),
        )

    def drop_behind(self) -> None:
        """The step failed before the optimizer state arrived: the parameters alone are no state."""
        if self.behind is None:
            return
        log.warning("the optimizer state of step %s had not arrived when its generation ended: this process holds no whole state now", self.standing.step)
        self.behind = None
        self.standing.lost()

    def provide(self, gen: int, step: int, shard: Optional[int] = None, part: str = "all") -> Any:
        """What the StateServer serves (state/transfer.py): a held copy, the live state, or a refusal naming what is held."""
        s = self.standing
        copy = self.shards.get(shard, step) if self.shards is not None and shard is not None else None
        if copy is not None:
            entries, meta = copy
        elif part == "rest" and self.serves_behind(gen, step):
            entries, meta = self.engine.collect(step)
        elif s.training or s.step != step or (self.shards is not None and shard not in self.shards.live_shards()):
            what = f"step {s.step} (training={s.training})" if self.shards is None else f"{self.shards.describe(s.step)}"
            raise StaleState(f"{self.node} holds {what}; asked for step {step} of generation {gen}" + (f", shard {shard}" if shard is not None else ""))
        else:
            entries, meta = self.engine.collect(s.step, shard=shard)
        fault = (self.faults.due("optimizer", step) if part != "first" else None) or self.faults.due("send", step)
        if fault is not None and fault.kind in faultlib.WIRE:
            self.faults.done.add(fault.index)
            self.faults.report(fault, fault.at, gen, step)
            log.warning("injecting fault: %s, in the %s served (training=%s)", fault.describe(), Want(gen, step, shard, part).describe(), s.training)
            return entries, meta, fault.kind.split("_")[0], "optimizer" if fault.at == "optimizer" else "first"  # "corrupt" | "truncate"
        if fault is not None:
            self.faults.fire(fault, step)
        return entries, meta

    def serves_behind(self, gen: int, step: int) -> bool:
        """Whether the optimizer state of ``step`` can be served while this rank trains it: in the
        same generation, before its own update changes it. The update waits for the step's last
        collective, which a rank that fetches it contributes only once it holds it (land_behind)."""
        s = self.standing
        return self.shards is None and gen == s.gen and s.step == step and self.engine.state_step == step and self.behind is None


def _by_source(by_source: Dict[str, int]) -> str:
    return ", ".join(f"{w} ({n / 1e6:.1f} MB)" for w, n in by_source.items())
