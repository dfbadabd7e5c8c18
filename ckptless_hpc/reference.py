"""The reference: the training a job's config describes, as a plain PyTorch loop in one process.

``python -m ckptless_hpc.reference [the job's overrides] --compare RUN_DIR [--tol 1e-5]`` trains
the config the job trained (composed as the job composes it; with no overrides, the run's own
``.hydra/config.yaml``) and prints, per tensor of the run's ``final/model.pt``, the largest
difference relative to the tensor's magnitude, worst first. Exit 0 within the tolerance, 1
beyond it, 2 for bad input (the field and a HINT), 3 when the reference's own training fails.

Nothing of the engine is used: no buckets, no communicator, no sharding. What is shared with the
framework is its contract, not its maths: the task (model, optimizer, scheduler, loss, hook), the
data of (seed, step, rank, micro-batch) and the RNG seed of each forward (train/data.py). The rest
is written here from the documented semantics (docs/tasks.md, "The step"):

- the gradient of a step is the mean of the ``world x K`` micro-batch gradients (each micro-batch
  loss backpropagated on its own, the sum divided once);
- ``torch.nn.utils.clip_grad_norm_`` on that mean, after unscaling (fp16);
- ``torch.autocast`` for bf16 and fp16, ``torch.amp.GradScaler`` (its defaults) for fp16;
- the task's own scheduler stepped once per step (``ReduceLROnPlateau`` with the step's mean
  loss), or the documented warm-up + cosine schedule;
- buffers (BatchNorm statistics) as torch DDP keeps them: rank 0's, from its own micro-batches;
  the other ranks' forwards start from the step's buffers and leave nothing behind;
- the task's ``on_step_end`` after each committed optimizer update; ``train.on_nonfinite=skip``
  drops a step with a non-finite loss (or gradient norm, without fp16) and keeps its buffers;
- ``train(..., evals={})`` also evaluates where the job does (``train.eval_every``): the task's
  ``evaluate`` on the ``train.eval_batches`` validation batches, each metric their mean.

The sums run in another order than the job's (one ``.grad`` accumulates every micro-batch of
every rank; the job reduces per rank, then over ranks), so equality is within a tolerance, not
bitwise, except where docs/tasks.md ("The determinism contract") says so. Torch is imported when
training starts: a bad override is refused in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

__all__ = [
    "train",
    "evaluate",
    "differences",
    "max_differences",
    "warmup_cosine",
    "compose_config",
    "build_task",
    "table",
    "main",
    "DEFAULT_TOL",
]

EXIT_WITHIN, EXIT_BEYOND, EXIT_USAGE, EXIT_TRAINING = 0, 1, 2, 3
DEFAULT_TOL = 1e-5
PROG = "python -m ckptless_hpc.reference"
USAGE_HINT = f"{PROG} [the job's overrides] --compare RUN_DIR [--tol {DEFAULT_TOL:g}] (--help says more)"

#: What changes the trained weights: the reference notes where the run's own config differs here.
TRAINING_KEYS = ("task", "optim", "parallel", "train.steps", "train.seed", "train.threads", "train.grad_accum", "train.clip_grad_norm", "train.precision", "train.on_nonfinite")


class UsageError(ValueError):
    """Bad input: the message names the field or the value and ends with a HINT."""


class TrainingError(RuntimeError):
    """The reference's own training cannot go on (what the job would have stopped on)."""


# ============================================================================== the plain loop
def warmup_cosine(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """docs/configuration.md: linear warm-up to ``lr`` over ``warmup`` steps, cosine to ``lr x min_ratio``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * min_ratio + (lr - lr * min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def _amp_dtype(precision: str) -> Any:
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _own_hook(task: Any) -> Any:
    """The task's ``on_step_end``, if it defines one (the base class's does nothing)."""
    from .tasks.base import Task

    fn = getattr(task, "on_step_end", None)
    return None if not callable(fn) or getattr(type(task), "on_step_end", None) is Task.on_step_end else fn


def evaluate(task: Any, model: Any, cfg: Any) -> Dict[str, float]:
    """The job's evaluation of ``model`` in one process: the task's ``evaluate`` on validation
    batches ``0 .. train.eval_batches - 1`` (drawn as the job's ranks draw them), under
    ``no_grad`` and ``model.eval()``, each metric the mean over the batches in float64."""
    import torch

    from .config import data_world
    from .train.evaluation import MetricSums, ValSource

    t = cfg.train
    val, world, batches, amp = ValSource(task, int(t.seed)), data_world(cfg), int(t.eval_batches), _amp_dtype(str(t.precision))
    sums = MetricSums(f"{type(task).__name__}.evaluate")
    model.eval()
    try:
        with torch.no_grad():
            for index in range(batches):
                batch = val.batch(index, index % world, world)  # the data rank that evaluates it in the job
                with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                    sums.add(task.evaluate(model, batch), torch.device("cpu"))
    finally:
        model.train()
    return dict(zip(sums.names, (sums.sums / batches).tolist())) if sums.names and sums.sums is not None else {}


def train(task: Any, cfg: Any, evals: Optional[Dict[int, Dict[str, float]]] = None, steps: Optional[Dict[int, Dict[str, float]]] = None) -> Any:
    """The model after ``cfg.train.steps`` steps of the job ``cfg`` describes (a ``torch.nn.Module``);
    with ``evals`` (a dict) and ``train.eval_every``, also :func:`evaluate` after each step the job
    evaluates after, filled in as ``evals[committed steps] = {name: value}``; with ``steps`` (a
    dict), each step's mean loss and the task's own metrics (``loss`` returning ``(loss, {...})``),
    means over the global batch, as ``steps[committed steps] = {"loss": ..., name: ...}``.

    Raises :class:`TrainingError` where the job would have stopped: a non-finite step under
    ``train.on_nonfinite=stop``, or more skipped steps than ``train.max_skipped_fraction`` allows."""
    import torch

    from .train.data import StepBatches, forward_seed
    from .train.evaluation import eval_due

    def evaluated(step: int) -> None:  # after ``step`` committed steps, where the job evaluates
        if evals is not None and eval_due(step, int(t.get("eval_every", 0) or 0), int(t.steps)):
            evals[step] = evaluate(task, model, cfg)

    from .config import data_world

    t, o = cfg.train, cfg.optim
    world, k = data_world(cfg), int(t.grad_accum)  # tensor parallel: one data rank per TP group
    amp = _amp_dtype(str(t.precision))
    torch.manual_seed(int(t.seed))
    model = task.build_model()
    opt = task.build_optimizer(model, o)
    own = getattr(task, "build_scheduler", None)
    sched = own(opt, o, int(t.steps)) if callable(own) else None
    plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    hook = _own_hook(task)
    scaler = torch.amp.GradScaler("cpu") if t.precision == "fp16" else None
    data = StepBatches(task, int(t.seed), world, k)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers()]
    skip = str(t.get("on_nonfinite", "stop")) == "skip"
    budget, skipped = math.floor(float(t.get("max_skipped_fraction", 0.0)) * int(t.steps) + 1e-9), 0
    for step in range(int(t.steps)):
        model.train()
        opt.zero_grad(set_to_none=False)
        start = [b.clone() for b in buffers]
        loss_sum, metric_sums = 0.0, {}
        for rank in [*range(1, world), 0]:  # rank 0 last: its statistics are what remains
            for b, s in zip(buffers, start):
                b.copy_(s)
            for micro in range(k):
                batch = data.batch(step, micro, rank)
                forward_seed(int(t.seed), step, rank, micro)
                with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                    loss = task.loss(model, batch)
                if isinstance(loss, tuple):  # (loss, the task's own metrics)
                    for name, v in loss[1].items():
                        metric_sums[name] = metric_sums.get(name, 0.0) + float(v.detach().to(torch.float64) if torch.is_tensor(v) else v)
                    loss = loss[0]
                loss_sum += float(loss.detach().to(torch.float64))
                (scaler.scale(loss) if scaler is not None else loss).backward()
        mean_loss = loss_sum / (world * k)
        if steps is not None:
            steps[step + 1] = {"loss": mean_loss, **{name: v / (world * k) for name, v in metric_sums.items()}}
        for p in params:
            p.grad.div_(world * k)
        if scaler is not None:
            scaler.unscale_(opt)
        if t.clip_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, float(t.clip_grad_norm)))
        else:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in params])) if scaler is None else 0.0
        if not math.isfinite(mean_loss) or (scaler is None and not math.isfinite(norm)):
            if not skip or skipped >= budget:
                why = "train.on_nonfinite=stop" if not skip else f"train.max_skipped_fraction allows {budget} skipped step(s)"
                raise TrainingError(f"step {step}: loss {mean_loss}, gradient norm {norm}: not finite, and {why}: the job stops here too (exit 7), with no final model")
            skipped += 1
            for b, s in zip(buffers, start):
                b.copy_(s)
            if sched is not None and not plateau:
                sched.step()  # the LR stays a function of the step index
            evaluated(step + 1)
            continue
        if sched is None:
            for g in opt.param_groups:
                g["lr"] = warmup_cosine(step, float(o.lr), int(o.warmup_steps), int(t.steps), float(o.min_lr_ratio))
        updated = True
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            updated = scaler.get_scale() >= scale  # a lower scale: inf/NaN gradients, the update was skipped
        else:
            opt.step()
        if plateau:
            sched.step(mean_loss)
        elif sched is not None:
            sched.step()
        if hook is not None and updated:
            with torch.no_grad():
                hook(model, opt, step)
        evaluated(step + 1)
    return model


# ============================================================================== comparing (pure)
def _relative(g: Any, w: Any) -> float:
    """The largest absolute difference relative to ``w``'s largest magnitude (floating and complex
    tensors); 0 or 1 (any element differs) for integer and bool tensors."""
    if w.numel() == 0:
        return 0.0
    if w.is_floating_point() or w.is_complex():
        g = g.to(w.dtype)
        return float((g - w).abs().max()) / max(float(w.abs().max()), 1e-12)
    return float((g.to(w.dtype) != w).any())


def differences(got: Dict[str, Any], want: Dict[str, Any]) -> Dict[str, float]:
    """Per key of either, the largest relative difference (:func:`_relative`); ``inf`` for a key
    only one of them holds, or tensors of other shapes."""
    out: Dict[str, float] = {}
    for key in sorted(set(got) | set(want)):
        if key not in got or key not in want or tuple(got[key].shape) != tuple(want[key].shape):
            out[key] = math.inf
        else:
            out[key] = _relative(got[key], want[key])
    return out


def max_differences(got: Dict[str, Any], want: Dict[str, Any]) -> Dict[str, float]:
    """Per tensor, the largest absolute difference relative to the tensor's largest magnitude;
    the two must hold the same keys and shapes (an ``AssertionError`` names what differs)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k, w in want.items():
        assert tuple(got[k].shape) == tuple(w.shape), (k, tuple(got[k].shape), tuple(w.shape))
    return {k: _relative(got[k], w) for k, w in want.items()}


def _worst_first(diffs: Dict[str, float]) -> List[str]:
    """The keys, the largest difference first (NaN with the infinite ones), then by name."""
    return sorted(diffs, key=lambda k: (-(diffs[k] if diffs[k] == diffs[k] else math.inf), k))


def _what(t: Optional[Any]) -> Tuple[str, str]:
    return ("-", "-") if t is None else ("x".join(map(str, t.shape)) or "scalar", str(t.dtype).replace("torch.", ""))


def table(diffs: Dict[str, float], got: Dict[str, Any], want: Dict[str, Any]) -> List[str]:
    """The lines of the comparison table, worst first (then by name)."""
    rows = []
    for key in _worst_first(diffs):
        shape, dtype = _what(want.get(key, got.get(key)))
        d = diffs[key]
        if key not in got:
            value = "missing in the run"
        elif key not in want:
            value = "not in the reference"
        elif tuple(got[key].shape) != tuple(want[key].shape):
            value = f"other shape: {_what(got[key])[0]} in the run"
        else:
            value = f"{d:.3g}"
        rows.append((key, value, shape, dtype))
    head = ("tensor", "max rel diff", "shape", "dtype")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]


def verdict(diffs: Dict[str, float], tol: float) -> Tuple[int, str]:
    """(exit code, the closing line)."""
    if not diffs:
        return EXIT_BEYOND, "nothing to compare: neither model holds a tensor. HINT: give the run's final/model.pt"
    worst = _worst_first(diffs)[0]
    beyond = [k for k, d in diffs.items() if not d <= tol]
    if not beyond:
        equal = " (every tensor equal)" if diffs[worst] == 0 else ""
        return EXIT_WITHIN, f"within the tolerance: the largest relative difference is {diffs[worst]:.3g} ({worst}) <= {tol:g}{equal}"
    return EXIT_BEYOND, (
        f"beyond the tolerance: {len(beyond)} of {len(diffs)} tensor(s) differ by more than {tol:g}, the worst {worst} by {diffs[worst]:.3g}. "
        "HINT: give the reference the overrides the job ran with (or none, and the run's .hydra/config.yaml is read), from the same code; "
        'an order of summation alone stays far below 1e-5 (docs/tasks.md, "The determinism contract")'
    )


def config_differences(run: Any, here: Any) -> List[str]:
    """``key (run: a, here: b)`` for each training key (:data:`TRAINING_KEYS`) the two configs set apart."""
    from omegaconf import OmegaConf

    def flat(cfg: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key in TRAINING_KEYS:
            section, _, field = key.partition(".")
            node = cfg.get(section)
            if field:
                out[key] = None if node is None else node.get(field)
            elif node is not None:
                out.update({f"{section}.{k}": v for k, v in OmegaConf.to_container(node, resolve=False).items()})
        nodes, per_node = cfg.cluster.nodes, cfg.cluster.workers_per_node
        out["world"] = f"{nodes}x{per_node}"
        return out

    a, b = flat(run), flat(here)
    return [f"{k} (run: {a.get(k)!r}, here: {b.get(k)!r})" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


# ============================================================================== the config, the task, the run
def compose_config(overrides: Sequence[str]) -> Any:
    """The job's config for ``overrides``, composed exactly as ``python -m ckptless_hpc`` composes
    it (the package's config module and schema); a bad override raises :class:`UsageError`."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__) else e
        key = getattr(cause, "full_key", None)
        what = (str(cause).splitlines() or [type(cause).__name__])[0].rstrip(".")
        raise UsageError(
            f"invalid configuration: {f'{key}: ' if key else ''}{what}. HINT: give the overrides the job ran with, spelled as for "
            "`python -m ckptless_hpc` (docs/configuration.md); `python -m ckptless_hpc --cfg job` prints every key with its value"
        ) from None


def run_config(path: str) -> Any:
    """The run's own composed config (``RUN_DIR/.hydra/config.yaml``), or None."""
    from omegaconf import OmegaConf

    from .rundir.paths import RunPaths

    p = RunPaths(path).hydra_config
    return OmegaConf.load(p) if os.path.isfile(p) else None


def check_config(cfg: Any) -> None:
    """The job's own validation of a composed config (the checks that need no saved state: a
    run's own config was validated when it ran); raises :class:`UsageError`."""
    from .config import ConfigError, validate

    try:
        validate(cfg)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def build_task(cfg: Any) -> Any:
    """The task of ``cfg``, instantiated as the job's workers instantiate it (``hydra.utils.instantiate(cfg.task)``);
    a task that does not import here, or refuses its arguments, raises :class:`UsageError`."""
    from .launch.task_check import task_errors

    target = cfg.task.get("_target_") if cfg.get("task") is not None else None
    if isinstance(target, str) and "." in target:
        module = target.rpartition(".")[0]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UsageError(
                f"task._target_={target}: module {module!r} cannot be imported here ({e}). HINT: the reference imports the task as the "
                f"job's workers did: run it from the directory the job ran from, or put the folder that holds {module.split('.')[0]!r} on "
                f"PYTHONPATH (PYTHONPATH=/that/folder {PROG} ...), or pip install the task's package"
            ) from None
    errors = task_errors(cfg.get("task"))
    if errors:
        raise UsageError("invalid configuration:\n  - " + "\n  - ".join(errors))
    from hydra.utils import instantiate

    try:
        return instantiate(cfg.task)
    except Exception as e:  # noqa: BLE001 - the task's constructor refused: bad input, said as such
        cause = e.__cause__ or e
        hint = "" if "HINT" in str(cause) else " HINT: check the task's arguments (task.*) against its constructor"
        raise UsageError(f"task._target_={target}: the task refused its arguments: {type(cause).__name__}: {cause}.{hint}") from None


def model_file(path: str) -> str:
    """The model file ``--compare`` names: a run directory's ``final/model.pt``, a ``final/``
    folder's ``model.pt``, or a file itself; :class:`UsageError` when there is none."""
    from .rundir.paths import MODEL, RunPaths

    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise UsageError(f"--compare {path}: no such file or directory. HINT: give the job's run directory (hydra.run.dir), or a model.pt")
    for candidate in (RunPaths(path).final_model, os.path.join(path, MODEL)):
        if os.path.isfile(candidate):
            return candidate
    raise UsageError(
        f"--compare {path}: no final model ({RunPaths(path).final_model} does not exist). HINT: the job writes it when it completes "
        "with train.save_final=true (the default); for a saved copy: `ckptless-hpc export COPY --out model.pt`, then --compare model.pt"
    )


def notes(cfg: Any) -> List[str]:
    """What of ``cfg`` the reference does not train as the job does, and what to expect of it."""
    out = []
    if cfg.get("resume_from"):
        out.append(f"resume_from={cfg.resume_from}: the reference trains from step 0 (what the resumed run continues, with the same config)")
    par = cfg.get("parallel") or {}
    if par.get("param_dtype") or par.get("reduce_dtype"):
        out.append("parallel.param_dtype/reduce_dtype: the reference computes in the parameters' own dtype; expect the difference that lower-precision compute makes")
    if cfg.train.get("compile", False):
        out.append("train.compile=true: the reference runs the model eagerly")
    return out


# ============================================================================== the command
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}. HINT: {USAGE_HINT}")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Train a job's config as a plain PyTorch loop in one process, and compare it with the run's final/model.pt "
        "per tensor (the largest difference relative to the tensor's magnitude, worst first). "
        "Exit 0 within the tolerance, 1 beyond it, 2 for bad input, 3 when the reference's own training fails.",
    )
    p.add_argument("overrides", nargs="*", help="the job's Hydra overrides (none: the run's own .hydra/config.yaml)")
    p.add_argument("--compare", metavar="RUN_DIR", help="the run directory (its final/model.pt), a final/ folder or a model file")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL, help=f"the largest relative difference allowed (default {DEFAULT_TOL:g}; 0: bitwise)")
    p.add_argument("--out", metavar="FILE", help="also write the reference's state_dict() there (torch.save)")
    return p


def _config_for(overrides: Sequence[str], compare: Optional[str], out: TextIO) -> Any:
    from .rundir.paths import RunPaths

    own = run_config(compare) if compare and os.path.isdir(compare) else None
    if not overrides and own is not None:
        print(f"config: the run's own ({RunPaths(compare).hydra_config})", file=out)
        return own
    cfg = compose_config(overrides)
    check_config(cfg)
    print(f"config: {len(overrides)} override(s) on the package's defaults" if overrides else "config: the package's defaults (no overrides)", file=out)
    if own is not None:
        differ = config_differences(own, cfg)
        if differ:
            print(f"note: the run was trained with another config: {'; '.join(differ)}", file=out)
    return cfg


def _load_model_file(path: str) -> Dict[str, Any]:
    """The state_dict in ``path``; :class:`UsageError` for a file that is not one."""
    import torch

    try:
        got = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - an unreadable file is bad input
        raise UsageError(f"--compare {path}: not a readable state_dict file ({type(e).__name__}: {e}). HINT: give the run's final/model.pt") from None
    if not isinstance(got, dict) or not all(isinstance(v, torch.Tensor) for v in got.values()):
        raise UsageError(f"--compare {path}: holds a {type(got).__name__}, not a state_dict of tensors. HINT: give the run's final/model.pt")
    return got


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """``python -m ckptless_hpc.reference [overrides] --compare RUN_DIR [--tol T] [--out FILE]``."""
    try:
        args = parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
        if not (args.tol >= 0 and math.isfinite(args.tol)):
            raise UsageError(f"--tol {args.tol}: must be a finite number >= 0. HINT: --tol {DEFAULT_TOL:g} (0: bitwise equal)")
        if args.compare is None and args.out is None:
            raise UsageError(f"nothing to do: neither --compare nor --out given. HINT: {USAGE_HINT}")
        target = model_file(args.compare) if args.compare is not None else None
        cfg = _config_for(args.overrides, args.compare, out)
        task = build_task(cfg)
        got = _load_model_file(target) if target is not None else None  # before training: a bad file costs no training
    except UsageError as e:
        print(f"{PROG}: {e}", file=err)
        return EXIT_USAGE
    import torch

    torch.set_num_threads(int(cfg.train.threads))  # as the job's workers: results depend on it
    for line in notes(cfg):
        print(f"note: {line}", file=out)
    from .config import data_world

    world, k = data_world(cfg), int(cfg.train.grad_accum)
    t0 = time.monotonic()
    try:
        model = train(task, cfg)
    except TrainingError as e:
        print(f"{PROG}: the reference cannot train this config: {e}", file=err)
        return EXIT_TRAINING
    except Exception:  # noqa: BLE001 - the task's own code raised: its traceback, and not exit 1 (that says "beyond the tolerance")
        print(f"{PROG}: the reference's training raised (the task's code, or a config it cannot train):\n{traceback.format_exc()}", file=err)
        return EXIT_TRAINING
    want = model.state_dict()
    print(
        f"trained {cfg.train.steps} steps of {cfg.task._target_} in one process (world {world} x grad_accum {k}, {cfg.train.precision}) in {time.monotonic() - t0:.1f} s", file=out
    )
    if args.out is not None:
        torch.save(want, args.out)
        print(f"wrote the reference's state_dict to {args.out}", file=out)
    if got is None:
        return EXIT_WITHIN
    diffs = differences(got, want)
    print(f"compared with {target} ({len(got)} tensors), tolerance {args.tol:g} (the largest difference relative to the tensor's largest magnitude):", file=out)
    for line in table(diffs, got, want):
        print(line, file=out)
    code, line = verdict(diffs, args.tol)
    print(line, file=out)
    return code


if __name__ == "__main__":
    sys.exit(main())
