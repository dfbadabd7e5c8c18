"""The steps of one generation, as the worker drives them: the engine's step with the worker's
waits (interruptible by the coordinator), the injected faults at their points, the copies after
a commit (periodic copies, shard copies), the metrics and the evaluations rank 0 reports, and
the ``done`` message at the last step.

Bitwise reproducibility is the engine's (train/engine.py): this loop only decides when a step
runs, what it waits for and what is said about it.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from typing import Any, List, Optional

from ..control.client import exit_now
from ..control.messages import COLLECTIVE_ERROR, Done, Eval, Metrics, NonFinite, held_reason
from ..state.snapshot import state_sha256
from ..train import cuda
from ..train.engine import StepResult
from ..train.evaluation import eval_due
from ..train.grouped import StepFailed
from .exits import EXIT_CUDA_POISONED
from .groups import Groups
from .injector import FaultInjector
from .interrupt import Aborted, CollectiveError, Waiter
from .peer_state import PeerState
from .periodic import PeriodicCopies
from .seams import EngineSteps, Sender
from .shard_copies import ShardCopies
from .standing import Standing

log = logging.getLogger("ckptless_hpc.worker")


class Steps:
    """Collaborators passed in; ``samples`` is the global batch in samples (None when the task's
    batch size is not an int), for rank 0's metrics."""

    def __init__(
        self,
        cfg: Any,
        engine: EngineSteps,
        client: Sender,
        standing: Standing,
        waiter: Waiter,
        faults: FaultInjector,
        peers: PeerState,
        shards: Optional[ShardCopies],
        periodic: PeriodicCopies,
        groups: Groups,
        samples: Optional[int],
    ) -> None:
        self.train_cfg, self.collective_timeout_s = cfg.train, cfg.cluster.collective_timeout_s
        self.engine, self.client, self.standing, self.waiter, self.faults = engine, client, standing, waiter, faults
        self.peers, self.shards, self.periodic, self.groups, self.samples = peers, shards, periodic, groups, samples

    def _abandon(self, failed: Optional[BaseException] = None) -> None:
        """Let go of the generation (its groups destroyed in the background, train/grouped.py);
        ``failed``: what cut the step short, whose frames are cleared first. They hold the step's
        groups (the communicator, the stages, the schedule), and the last reference must go in the
        release thread: destroying a gloo group waits for its op in flight (an all-reduce with a
        live peer that left the step too) up to cluster.collective_timeout_s, and a main thread
        that dropped it with the exception would hold no Held that long (pp x tp, issue: a rank's
        "collective failed" logged, its Held never sent, the job's state lost)."""
        _clear_frames(failed)
        self.peers.drop_behind()
        self.groups.abandon()

    def run(self, gen: int) -> Optional[str]:
        """Train generation ``gen`` up to ``train.steps`` (then ``done``), or until it is cut short;
        the reason when a collective failed (the caller reports what it holds)."""
        s, steps = self.standing, self.train_cfg.steps
        s.training = True
        self.waiter.committed(s.step)  # a planned move's boundary counts from the step this generation starts at
        try:
            while True:
                if self.waiter.cut(gen):
                    self._abandon()
                    return None
                if eval_due(s.step, int(self.train_cfg.eval_every), steps):  # redone by a generation that starts here
                    self._evaluate(gen)
                if s.step >= steps:
                    break
                if not self._one_step(gen):
                    return None
        except Aborted as e:
            self._abandon(e)
            return None
        except (CollectiveError, StepFailed) as e:
            self._abandon(e)
            log.warning("collective failed at step %d: %s", s.step, e)
            s.training = False
            return held_reason(COLLECTIVE_ERROR, e)
        except Exception as e:
            if cuda.poisons_context(e):  # never "recovered" in place: the spare path replaces this process
                log.error("CUDA error at step %d poisons this process: %s; exiting to be replaced by a spare", s.step, e)
                exit_now(EXIT_CUDA_POISONED)
            raise
        finally:
            s.training = False
        self._done(gen)
        return None

    def _done(self, gen: int) -> None:
        s = self.standing
        entries, meta = self.engine.collect(s.step)
        sha256, shards = state_sha256(entries, meta), self.shards
        if shards is None:
            self.client.send(Done(gen, sha256, s.rank, s.step))
            return
        # sharded: its shard (and the lost ranks' it steps in a job that shrank), the host memory its
        # snapshots and held copies take, its waits for acks, snapshots, bytes sent (bench B8)
        adopted = {str(v): state_sha256(*self.engine.collect(s.step, shard=v)) for v in shards.owned[1:]} or None
        self.client.send(Done(gen, sha256, s.rank, s.step, shard=shards.shard, copies_bytes=shards.nbytes(), copy_costs=shards.costs(), adopted=adopted))

    def _one_step(self, gen: int) -> bool:
        """One step; False when it was refused (non-finite, train.on_nonfinite=stop)."""
        s = self.standing
        step = s.step
        t0 = time.perf_counter()
        if self.peers.behind is not None:
            self.peers.start_behind(step)
        res = self.engine.step(step, lambda: self._after_backward(step, t0), lambda futures: self._wait(futures, gen, step))
        if not res.committed:
            self._report_nonfinite(gen, step, res)
            return False
        self.faults.fire_due("update", step)  # right after the optimizer update: before the step is counted or copied
        if res.skipped:
            log.warning("step %d skipped (%s): loss %s, grad norm %s", step, res.skipped, res.loss, res.grad_norm)
        s.at(step + 1)
        self.waiter.committed(s.step)  # a planned move's boundary reached: the loop holds before the next step
        if self.shards is not None:
            self.shards.committed(self.engine, s.step)
        self.periodic.after_commit(s.step, 0 if s.lead else s.rank, self.shards.owned if self.shards is not None else [0], self.engine.collect)
        self.groups.works(gen)  # this generation works: what the older ones left can go
        if s.lead:
            self.client.send(
                Metrics(
                    s.step,
                    res.loss,
                    time.perf_counter() - t0,
                    gen=gen,
                    lr=res.lr,
                    grad_norm=res.grad_norm,
                    samples=self.samples,
                    skipped=res.skipped,
                    skipped_total=dict(self.engine.skipped),
                    metrics=res.metrics or None,
                )
            )
        return True

    def _evaluate(self, gen: int) -> None:
        """The evaluation after ``step`` committed steps (a failure in it is a step's: the
        generation that recovers starts at this step and evaluates again)."""
        step, t0 = self.standing.step, time.perf_counter()
        values = self.engine.evaluate(step, lambda futures: self._wait(futures, gen, step), lambda: self.faults.fire_due("eval", step))
        if self.standing.lead:
            self.client.send(Eval(step, values, gen=gen, eval_s=time.perf_counter() - t0))

    def _report_nonfinite(self, gen: int, step: int, res: StepResult) -> None:
        what = f"loss {res.loss}" if not math.isfinite(res.loss) else f"gradient norm {res.grad_norm}"
        why = "train.on_nonfinite=stop" if res.over_budget is None else f"train.on_nonfinite=skip has dropped {res.over_budget} steps, train.max_skipped_fraction's limit"
        log.error("step %d: %s is not finite; the state stays at step %d (%s)", step, what, self.standing.step, why)
        self.client.send(NonFinite(step, _num(res.loss), _num(res.grad_norm), self.standing.rank, gen, held=self.standing.step, skipped=res.over_budget))

    def _after_backward(self, step: int, t0: float) -> None:
        """The injected faults of this step, after its backward and before its collectives land."""
        self.faults.straggle(step, t0)
        self.standing.compute_s = time.perf_counter() - t0
        self.faults.fire_due("step", step)
        if self.peers.behind is not None:  # parameters first: the last collective waits for the optimizer state
            self.peers.land_behind(self.standing.gen, step)
        if self.shards is not None:  # the last collective of this step waits for our last copy (shards.py)
            self._await_copy(self.standing.gen, step)

    def _await_copy(self, gen: int, step: int) -> None:
        shards = self.shards
        t0 = time.perf_counter()
        refused = lambda: shards.replicator.refused  # noqa: E731
        outcome = self.waiter.wait_until(lambda: shards.copy_confirmed() or refused() is not None, gen, self.collective_timeout_s)
        shards.waited(time.perf_counter() - t0)
        if refused() is not None:  # no retry can cure it: the job's error (worker_failed), naming the tensor and its dtype
            raise RuntimeError(f"rank {self.standing.rank}, step {step}: {refused()}")
        if outcome == "abort":
            raise Aborted("replication")
        if outcome == "timeout":
            raise CollectiveError(f"the copy of step {shards.pending} was not acknowledged by its holders within {self.collective_timeout_s}s: {shards.last_error}")

    def _wait(self, futures: List[Any], gen: int, step: int) -> None:
        timeout_s = self.collective_timeout_s
        for f in futures:
            f.add_done_callback(lambda _f: self.waiter.wake.set())
        outcome = self.waiter.wait_until(lambda: all(f.done() for f in futures), gen, timeout_s)
        if outcome == "abort":
            raise Aborted("allreduce")
        if outcome == "timeout":
            raise CollectiveError(f"allreduce at step {step} timed out after {timeout_s}s")
        try:
            for f in futures:
                f.wait()
        except Exception as e:  # gloo raises RuntimeError subclasses on a lost peer
            raise CollectiveError(f"allreduce at step {step}: {e}") from None


def _clear_frames(e: Optional[BaseException]) -> None:
    """The locals of the finished frames of ``e``'s tracebacks (its context's and cause's too)
    dropped, keeping the exceptions' messages (the frames still running are left as they are)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def _num(x: float) -> Any:
    """A float for JSON: non-finite values as their names ("nan", "inf")."""
    return x if math.isfinite(x) else str(x)
