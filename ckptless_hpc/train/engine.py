"""The training engine: builds model, optimizer, LR scheduler and grad scaler from the task,
binds to one generation's communicator, runs one step, and gives and takes the state.

What differs between the parallel modes is the engine's ``strategy`` (:mod:`.strategy`: how a
rank holds the state, how gradients are reduced, what a generation's groups are); the rest is
here. One step (``train.grad_accum = K`` micro-batches per rank):

1. for each micro-batch: seed, forward (under autocast for bf16/fp16), backward; the strategy
   reduces the gradients (the replicated one: the last backward launches the bucket allreduces,
   :mod:`.replicated`) and rank 0's buffers are broadcast;
2. wait for every collective (interruptibly: the worker's ``wait``); a step that fails here
   leaves the state exactly as committed (buffers put back, no optimizer step);
3. gradient = sum over ranks and micro-batches / (world * K): the mean over the global batch;
4. a non-finite loss (or, without a grad scaler, gradient norm) is never committed silently:
   ``train.on_nonfinite=stop`` keeps the last committed state and reports it,
   ``skip`` drops the step (identically on every rank: the values are global) and counts it;
5. fp16: unscale; clip to ``train.clip_grad_norm``; optimizer step (the grad scaler skips it on
   inf/NaN gradients, on every rank alike) and the LR: the built-in warm-up + cosine as a
   function of the step, or the task's own scheduler stepped once per step;
6. the task's ``on_step_end`` after an optimizer update that was committed.

The task's own metrics (``loss`` returning ``(loss, {...})``) ride in the loss's all-reduce;
:meth:`Engine.evaluate` runs ``train.eval_every``'s evaluation (:mod:`.evaluation`).

State (see :mod:`ckptless_hpc.state.snapshot`): parameters, buffers, optimizer moments and the
task's tensors as pieces keyed by name and owner, plus metadata: the scheduler's and the grad
scaler's state (carried, not derived: a user scheduler may depend on anything, e.g. the loss
history of ``ReduceLROnPlateau``, and replaying it would cost O(step)) and the skipped-step
counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..state.snapshot import Entries, Piece, apply_model_state, apply_optimizer_state
from ..state.views import UserView, model_tensors
from ..tasks.base import set_lr
from . import strategy as strategies
from .data import Feed, forward_seed, make_feed
from .evaluation import MetricSums, ValSource, eval_indices, split_loss
from .replicated import BufferSync

PRECISIONS: Dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_Schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


@dataclass
class StepResult:
    loss: float  # mean over the global batch
    grad_norm: float  # global L2 norm of the reduced gradient, before clipping
    lr: float  # the LR this step used (first param group)
    committed: bool = True  # False: on_nonfinite=stop refused the step; the state is the previous one
    skipped: Optional[str] = None  # "nonfinite" (on_nonfinite=skip) or "overflow" (fp16 scaler): no update
    metrics: Dict[str, float] = field(default_factory=dict)  # the task's own (loss() -> (loss, {...})), global means
    over_budget: Optional[int] = None  # refused because on_nonfinite=skip has dropped this many steps, its limit


def skip_budget(steps: int, max_skipped_fraction: float) -> int:
    """How many non-finite steps ``train.on_nonfinite=skip`` may drop in a job of ``steps`` steps
    (``train.max_skipped_fraction`` of them, rounded down): one more stops the job (exit 7)."""
    return math.floor(max_skipped_fraction * steps + 1e-9)


def _build_scheduler(task: Any, optimizer: torch.optim.Optimizer, cfg: Any) -> Any:
    fn = getattr(task, "build_scheduler", None)
    sched = fn(optimizer, cfg.optim, cfg.train.steps) if callable(fn) else None
    if sched is not None and not isinstance(sched, _Schedulers):
        raise ValueError(
            f"{type(task).__name__}.build_scheduler returned a {type(sched).__name__}, not a torch.optim.lr_scheduler "
            "scheduler. HINT: return e.g. torch.optim.lr_scheduler.OneCycleLR(optimizer, ...), or None for the built-in "
            "warm-up + cosine schedule (optim.warmup_steps, optim.min_lr_ratio)"
        )
    if sched is not None and getattr(sched, "optimizer", optimizer) is not optimizer:
        raise ValueError(f"{type(task).__name__}.build_scheduler returned a scheduler of another optimizer. HINT: build it on the optimizer it is given")
    return sched


def _refuse_sync_batchnorm(model: torch.nn.Module) -> None:
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if names:
        raise ValueError(
            f"the model has SyncBatchNorm layers ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), which "
            "ckptless_hpc cannot bind to its per-generation groups yet. HINT: keep torch.nn.BatchNorm*: every rank then "
            "takes rank 0's running statistics at each step, as torch DDP does by default"
        )


def _step_end_hook(task: Any, mode: str) -> Optional[Callable[[torch.nn.Module, torch.optim.Optimizer, int], None]]:
    """The task's ``on_step_end``, if it defines one (the base class's does nothing)."""
    from ..tasks.base import Task

    fn = getattr(task, "on_step_end", None)
    if not callable(fn) or getattr(type(task), "on_step_end", None) is Task.on_step_end:
        return None
    if mode == "zero":
        raise ValueError(
            f"{type(task).__name__}.on_step_end with parallel.mode=zero: after a step each rank holds the new values only of "
            "the parameters whose optimizer state it owns, so the hook would see stale ones. HINT: use parallel.mode=ddp "
            "(or fsdp, where the hook sees this rank's shard of every parameter)"
        )
    return fn


class Engine:
    """Model, optimizer, scheduler, scaler and data feed of one worker, for any generation; what
    differs between the parallel modes is its ``strategy`` (train/strategy.py)."""

    def __init__(self, cfg: Any, task: Any, device: torch.device, world: int, close_fds: Sequence[int] = ()) -> None:
        t = cfg.train
        self.cfg, self.task, self.device, self.world = cfg, task, device, world
        self.micro_batches = int(t.grad_accum)
        torch.manual_seed(t.seed)
        self.model = task.build_model().to(device)
        _refuse_sync_batchnorm(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(task).__name__}.build_model() has no trainable parameters. HINT: leave requires_grad=True on what should train")
        self.n_params = sum(p.numel() for p in params)
        # what a user takes away (state/views.py), read once from the plain model: its hooks may communicate once it is sharded
        self.user_view = UserView.of(self.model)
        self._user_view = self.user_view.to_json([n for n, _ in model_tensors(self.model)])
        # train.compile: the task's loss and evaluate get the compiled module; the state, the names
        # and the hook keep the model itself (no "_orig_mod." anywhere)
        self.run_model = torch.compile(self.model, backend=str(t.get("compile_backend", "inductor"))) if t.get("compile", False) else self.model
        self.mode = str(cfg.parallel.mode) if "parallel" in cfg else "ddp"
        self.optimizer = task.build_optimizer(self.model, cfg.optim)
        self.scheduler: Any = None
        self.strategy: strategies.Strategy = strategies.make(self)
        if not self.strategy.sharded:  # a sharded mode builds it with the rank's part of the optimizer
            self.scheduler = self.build_scheduler()
        self.amp_dtype = PRECISIONS[t.precision]
        self.scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16" else None
        self.buffers = BufferSync(self.model)
        self._loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
        self.metrics = MetricSums(f"{type(task).__name__}.loss")
        self._reduced = self._loss_sum  # what the step's loss all-reduce sums: the loss, the task's metrics
        self.val: Optional[ValSource] = ValSource(task, int(t.seed)) if int(t.eval_every) > 0 else None  # train.eval_every: evaluate()
        self.hook = _step_end_hook(task, self.mode)
        self.skipped: Dict[str, int] = {"nonfinite": 0, "overflow": 0}
        # ranks that compute the same batch (tensor parallel: a TP group): the data is split over world // same_batch
        self.same_batch = int(getattr(self.strategy, "same_batch", 1))
        self.feed: Feed = make_feed(task, t.seed, world // self.same_batch, self.micro_batches, t.steps, int(t.data_workers), int(t.prefetch), close_fds)
        self.comm: Any = None
        # the step whose state the tensors hold (None while an optimizer update is changing them):
        # a source serves the optimizer state of step s while it trains s, up to its update
        self.state_step: Optional[int] = 0

    # ------------------------------------------------------------------ generations
    @property
    def sharded(self) -> bool:
        return self.strategy.sharded

    def take_rank(self, rank: int) -> None:
        """This process is rank ``rank`` from now on (a rank never changes for a process): a
        sharded mode builds the rank's part of the optimizer (and its scheduler) here, before
        any state is loaded into it."""
        self.strategy.take_rank(rank)

    def build_scheduler(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        return _build_scheduler(self.task, optimizer or self.optimizer, self.cfg)

    def hold(self, ranks: Sequence[int]) -> None:
        """The ranks this process trains (its own; in a job that shrank, lost ones too): ZeRO
        steps their parts of the optimizer (train/zero.py)."""
        self.strategy.hold(ranks)

    def shards(self) -> List[int]:
        """The shards whose state this process holds live: its rank's, and under ZeRO the lost
        ranks' it steps in a job that shrank."""
        return self.strategy.shards()

    def bind(self, comm: Any) -> None:
        """Train with this generation's communicator from now on (same rank numbers)."""
        self.take_rank(comm.vranks[0])
        self.comm = comm
        self.feed.bind(comm.vranks[0] // self.same_batch)  # its own rank's data (a shrunk job's survivor trains the lost ones' too)
        self.strategy.bind(comm)

    def form_groups(self, store: Any, comm: Any, host: str, timeout_s: float) -> None:
        """The groups of ``comm``'s generation this mode needs besides it (hsdp: the shard and
        replicate groups, train/fsdp.py, as ``comm.hsdp``), on the generation's store."""
        self.strategy.form_groups(store, comm, host, timeout_s)

    def let_go(self, comm: Any) -> bool:
        """After a failed or abandoned step: True when the mode released the generation's groups
        itself (FSDP: destroyed at once, in a thread); False: the caller keeps ``comm``
        referenced and retires it once idle (destroying a stuck gloo group could block)."""
        return self.strategy.let_go(comm)

    def warm_up(self) -> Optional[Dict[str, float]]:
        """A hot spare's throwaway FSDP2 shard and step, so that its first real ``fully_shard``
        is fast (docs/sharding.md): the timings, or None in a mode that needs none."""
        return self.strategy.warm_up()

    def layout(self) -> Dict[str, int]:
        """For the worker's ``built`` message: the gradient buckets (none under FSDP2, which
        reduces its own) and the buffers synchronised from rank 0."""
        return {**self.strategy.layout(), "buffers": sum(len(b) for _, b in self.buffers.groups)}

    @property
    def task_batches(self) -> bool:
        """Whether the batches come from the task's ``batch()`` (whose determinism the worker
        checks), not from a ``dataset()`` the framework indexes itself."""
        return self.feed.batches.dataset is None

    # ------------------------------------------------------------------ one step
    def seed(self, step: int, rank: int, micro: int) -> None:
        """The forward's RNG (dropout) of ``rank``'s micro-batch: that of its data rank (a TP
        group's ranks draw the same)."""
        forward_seed(self.cfg.train.seed, step, rank // self.same_batch, micro)

    def add_loss(self, loss: torch.Tensor) -> None:
        self._loss_sum += loss.detach().to(torch.float64)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def restart_sums(self) -> None:
        """The loss and the task's metrics summed from zero (a step; the next rank a process trains)."""
        self._loss_sum.zero_()
        self.metrics.zero()

    def task_loss(self, batch: Any) -> torch.Tensor:
        """The task's loss on one micro-batch (under the caller's autocast); its own metrics, if
        it returns ``(loss, {...})``, are added to the step's sums."""
        loss, metrics = split_loss(self.task.loss(self.run_model, batch), self.task)
        if metrics is not None or self.metrics.names is not None:
            self.metrics.add(metrics or {}, self.device)
        return loss

    def reduction(self) -> torch.Tensor:
        """The vector the step's loss all-reduce sums (the loss sum alone without metrics)."""
        self._reduced = self.metrics.vector(self._loss_sum)
        return self._reduced

    def reduced(self, total: torch.Tensor) -> None:
        """The reduced loss (and metrics) vector, where a strategy reduced it out of place."""
        self._reduced = total

    def autocast(self) -> Any:
        if self.amp_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def step(self, step: int, on_backward: Callable[[], None], wait: Callable[[List[Any]], None]) -> StepResult:
        comm, t = self.comm, self.cfg.train
        self.model.train()
        self.restart_sums()
        if self.buffers:
            self.buffers.save()
        self.strategy.begin(comm, wait)  # ZeRO: the owners' parameters of the last step
        try:
            norm = self.strategy.forward_backward(step, comm, on_backward, wait)
            if self.buffers:
                self.buffers.land()
        except BaseException:
            self.buffers.restore()
            self.strategy.discard()
            self._loss_sum = torch.zeros(1, dtype=torch.float64, device=self.device)
            raise
        self.state_step = None
        res = self._update(step, self.world * self.micro_batches, t, norm)
        if self.hook is not None and res.committed and res.skipped is None:
            with torch.no_grad():
                self.hook(self.model, self.optimizer, step)
        self.state_step = step + 1 if res.committed else step
        return res

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _update(self, step: int, n: int, t: Any, norm: Optional[torch.Tensor] = None) -> StepResult:
        self.strategy.divide(n)
        loss = float(self._reduced[0]) / n
        metrics = self.metrics.means(self._reduced, self.world, n)
        if not math.isfinite(loss):
            return self._nonfinite(step, t, loss, float("nan"), metrics)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if norm is None:
            norm = self.strategy.grad_norm()
        grad_norm = float(norm)
        if self.scaler is None and not math.isfinite(grad_norm):
            return self._nonfinite(step, t, loss, grad_norm, metrics)
        if t.clip_grad_norm is not None:
            self.strategy.clip(float(t.clip_grad_norm), norm)
        parts = self.strategy.parts()
        for optimizer, scheduler in parts:
            if scheduler is None:
                set_lr(optimizer, self.cfg.optim, step, t.steps)
        lr = self._lr()
        skipped = None
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:  # inf/NaN gradients: the scaler skipped the update
                skipped = "overflow"
                self.skipped["overflow"] += 1
        else:
            for optimizer, _ in parts:
                optimizer.step()
        self.strategy.stepped()
        self._step_scheduler(loss)
        return StepResult(loss, grad_norm, lr, skipped=skipped, metrics=metrics)

    def _step_scheduler(self, loss: float) -> None:
        for _, scheduler in self.strategy.parts():
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(loss)
            elif scheduler is not None:
                scheduler.step()

    def _nonfinite(self, step: int, t: Any, loss: float, grad_norm: float, metrics: Dict[str, float]) -> StepResult:
        self.buffers.restore()
        lr = self._lr()
        if t.on_nonfinite == "stop":
            return StepResult(loss, grad_norm, lr, committed=False, metrics=metrics)
        if self.skipped["nonfinite"] >= skip_budget(t.steps, t.max_skipped_fraction):  # the same count on every rank: all stop here
            return StepResult(loss, grad_norm, lr, committed=False, over_budget=self.skipped["nonfinite"], metrics=metrics)
        self.skipped["nonfinite"] += 1
        for _, scheduler in self.strategy.parts():
            if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step()  # the LR stays a function of the step index
        return StepResult(loss, grad_norm, lr, skipped="nonfinite", metrics=metrics)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int, wait: Callable[[List[Any]], None], before_reduce: Callable[[], None] = lambda: None) -> Dict[str, float]:
        """The task's metrics on the ``train.eval_batches`` validation batches, averaged over all
        of them (every rank gets the same values): under ``torch.no_grad()`` and ``model.eval()``,
        the model back in train mode after. The training state is not touched (ZeRO brings the
        owners' parameters of the last step, as the next step would; a sharded model evaluates
        sharded). A failed collective raises as in a step (FSDP: ``StepFailed``). ``before_reduce``
        runs after the forwards, before the all-reduce is launched (the worker's fault point)."""
        assert self.val is not None, "evaluate() without train.eval_every"
        comm, batches = self.comm, int(self.cfg.train.eval_batches)
        self.strategy.begin(comm, wait)
        sums = MetricSums(f"{type(self.task).__name__}.evaluate")
        self.model.eval()
        try:
            with torch.no_grad():
                dup = self.same_batch
                for index, weight in eval_indices(comm.rank // dup, comm.world // dup, batches):
                    batch = self.val.batch(index, comm.rank // dup, comm.world // dup)
                    with self.autocast():
                        out = self.strategy.evaluate(batch)
                    sums.add(out, self.device, weight)
            total = sums.vector(torch.zeros(1, dtype=torch.float64, device=self.device))
            before_reduce()
            wait([comm.allreduce(total)])
        except BaseException:
            self.strategy.discard()
            raise
        finally:
            self.model.train()
        return sums.means(total, comm.world, batches * self.same_batch)

    # ------------------------------------------------------------------ state
    def pieces(self, step: int) -> Tuple[List[Piece], Dict[str, Any]]:
        """The state of ``step`` as keyed pieces (views, no copies) and metadata. Every piece of
        the replicated strategy is held by every rank (owner None)."""
        entries, meta = self.collect(step)
        return [Piece(k, v, None) for k, v in entries], meta

    def collect(self, step: int, shard: Optional[int] = None) -> Tuple[Entries, Dict[str, Any]]:
        """The state of ``step`` this rank holds: all of it (ddp), or its shard (views, no copies);
        ``shard``: under ZeRO, that of a lost rank this process steps in a job that shrank."""
        scheduler = self.strategy.scheduler_of(shard)
        extra = {
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped": dict(self.skipped),
            "user_view": self._user_view,
        }
        return self.strategy.collect(step, extra, shard)

    def build_model(self) -> torch.nn.Module:
        """A fresh, plain model of the task, to present a state through its own hooks (state/views.py); the RNG is left as it was."""
        with torch.random.fork_rng(devices=[]):
            return self.task.build_model()

    def apply(self, entries: Entries, meta: Dict[str, Any], copy: bool = False, shard: Optional[int] = None) -> None:
        """Load a state (a shard, in a sharded mode) into this rank. The optimizer keeps the
        tensors it is given: ``copy`` for buffers the caller reuses (a snapshot). ``shard``: a
        lost rank's (ZeRO, a job that shrank: :meth:`hold`), at the step of this rank's own."""
        if self.strategy.apply(entries, meta, copy, shard):
            self.apply_meta(meta)
            self.state_step = int(meta["step"])

    def apply_first(self, entries: Entries, meta: Dict[str, Any]) -> None:
        """Parameters first (the replicated strategy): the model's and the task's part of a state
        and its metadata (scheduler, scaler, counters), enough for a step's forward and backward;
        the optimizer's part follows with :meth:`apply_rest` before the optimizer step."""
        if self.sharded:
            raise ValueError(f"parallel.mode={self.mode}: parameters first is for the replicated state (ddp) only")
        apply_model_state(self.model, self.task, entries, meta)
        self.apply_meta(meta)
        self.state_step = None  # not a whole state until the optimizer's part is in

    def apply_rest(self, entries: Entries, meta: Dict[str, Any]) -> None:
        """The optimizer's part of the state :meth:`apply_first` started (the tensors are kept)."""
        apply_optimizer_state(self.optimizer, entries, meta, self.model)
        self.state_step = int(meta["step"])

    def apply_meta(self, meta: Dict[str, Any]) -> None:
        self.strategy.stepped()
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        self.skipped = dict(meta.get("skipped") or {"nonfinite": 0, "overflow": 0})

    def close(self) -> None:
        self.feed.close()
