"""Equal to plain PyTorch: a real job (2 or 4 ranks, real processes, a rank killed and replaced)
trains the same weights as the same training written as a plain loop in one process
(tests/plain_loop.py), feature by feature, within a tight tolerance.

The oracle elsewhere proves that a recovery changes nothing; this proves that the training is
right: the gradient is the mean over the global batch, clipping clips the global norm, the
scheduler, the precision and the sharded layouts do what plain PyTorch does. The tolerance is
a float summation order (the job reduces in buckets over ranks, the loop accumulates in one
``.grad``), orders of magnitude below the effect of any break of a divisor or a coefficient.
SGD is used wherever the gradient's scale matters (Adam would hide a wrong divisor).

A sharded final state is also checked against a view taken without the state path: each live
rank writes its full model from inside the job (tasks_for_tests/gather_tasks.py: its
``evaluate`` after the last step, DTensor shards gathered with ``full_tensor()``, ZeRO after the
owners' broadcast). The export must equal every rank's view bitwise, and that view must equal
plain PyTorch within the case's tolerance: an export that rebuilt the model from the shard
files wrongly, and a ``model.pt`` built by the same wrong function, would agree with each other
but not with the live ranks.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

import plain_loop
from ckptless_hpc.config import register_configs
from ckptless_hpc.tools.commands import main as tools_main

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TASKS_DIR = Path(__file__).parent / "tasks_for_tests"
ENV = {"PYTHONPATH": str(TASKS_DIR)}


def _task(name: str) -> tuple:
    return ("~task", f"+task._target_=engine_tasks.{name}")


SGD = (*_task("SGDGroupsMLP"), "optim.lr=0.05")
STEPS = ("train.steps=16",)
KILL0 = ("fault=kill_worker", "fault.rank=0", "fault.step=7")
KILL1 = ("fault=kill_worker", "fault.rank=1", "fault.step=9")

# feature -> (config, fault, tolerance: the largest difference relative to a tensor's magnitude)
SHRUNK = (
    *_task("BatchNormSGD"),
    "optim.lr=0.05",
    "cluster.nodes=3",
    "cluster.spare_nodes=0",
    "cluster.max_refills=0",
    "cluster.min_nodes=2",
    "train.grad_accum=2",
    "train.clip_grad_norm=0.05",
)
CASES = {
    "ddp_adamw_builtin_schedule": (("task=mlp", "optim.warmup_steps=4"), KILL1, 1e-5),
    "grad_accum": ((*SGD, "train.grad_accum=3"), KILL0, 1e-5),
    "clip_bites": ((*SGD, "train.clip_grad_norm=0.05"), KILL1, 1e-5),
    "buffers_dropout": ((*_task("BatchNormSGD"), "optim.lr=0.05"), KILL0, 1e-5),
    "bf16": ((*SGD, "train.precision=bf16"), KILL1, 1e-5),
    "fp16_scaler": ((*SGD, "train.precision=fp16"), KILL0, 1e-5),
    "zero": ((*SGD, "parallel=zero", "train.grad_accum=2", "train.clip_grad_norm=0.05"), KILL1, 1e-5),
    "fsdp": ((*_task("BatchNormSGD"), "optim.lr=0.05", "parallel=fsdp", "train.clip_grad_norm=0.05"), KILL1, 1e-5),
    "hsdp": ((*SGD, "parallel=hsdp", "parallel.shard_size=2", "cluster.workers_per_node=2", "train.grad_accum=2"), KILL1, 1e-5),
    # no spare (and no refill to grow back with): the node of rank 0 is lost and the job goes on shrunk, two processes training three ranks
    "shrunk_fixed_reduction": (SHRUNK, ("fault=kill_node", "fault.node=0", "fault.step=7"), 1e-5),
    # the same with ZeRO: a survivor steps rank 0's part of the optimizer too, from the copy a peer held
    "shrunk_zero": ((*SHRUNK, "parallel=zero", "replication.factor=1"), ("fault=kill_node", "fault.node=0", "fault.step=7"), 1e-5),
}


def _config(overrides):
    register_configs()
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKS_DIR))


def _gathering(cfg: Tuple[str, ...], gather_dir: Path) -> Tuple[str, ...]:
    """``cfg`` with its task swapped for the same task that writes each rank's full view after
    the last step (gather_tasks.py: one evaluation, at the end)."""
    gathered = tuple(o.replace("engine_tasks.SGDGroupsMLP", "gather_tasks.SGDGroupsGather").replace("engine_tasks.BatchNormSGD", "gather_tasks.BatchNormSGDGather") for o in cfg)
    assert gathered != cfg, f"no task of gather_tasks.py for {cfg}"
    steps = next(o for o in STEPS if o.startswith("train.steps=")).split("=")[1]
    return (*gathered, f"+task.gather_dir={gather_dir}", f"train.eval_every={steps}", "train.eval_batches=1")


def _live_views(gather_dir: Path) -> Dict[int, Dict[str, torch.Tensor]]:
    """Rank -> the full model that rank held after the last step, as it wrote it."""
    views: Dict[int, Dict[str, torch.Tensor]] = {}
    for f in sorted(gather_dir.glob("rank*.pt")):
        got = torch.load(f, weights_only=True)
        assert got["rank"] not in views, f"two views of rank {got['rank']} ({sorted(p.name for p in gather_dir.iterdir())}): one evaluation per rank expected"
        views[got["rank"]] = got["tensors"]
    return views


@pytest.mark.parametrize("case", list(CASES))
def test_job_trains_what_plain_pytorch_trains(case, job, tmp_path):
    cfg, fault, tol = CASES[case]
    cfg = (*cfg, *STEPS)
    sharded = any(o.startswith("parallel=") for o in cfg)
    gather_dir = tmp_path / "live_views"
    if sharded:
        gather_dir.mkdir()
        cfg = _gathering(cfg, gather_dir)
    res = job(*cfg, *fault, env=ENV)
    assert res.rc == 0, res.out[-4000:]
    s = res.summary
    assert s["status"] == "completed" and len(s["recoveries"]) == 1 and len(s["faults_fired"]) == 1, s
    got = torch.load(s["final"]["model"]["path"], weights_only=True)
    composed = _config(cfg)
    task = instantiate(composed.task)
    task.build_model().load_state_dict(got)  # the model file loads into a fresh model, strictly
    want = plain_loop.train(task, composed).state_dict()
    diffs = plain_loop.max_differences(got, want)
    worst = max(diffs, key=diffs.get)
    print(f"{case}: worst relative difference {diffs[worst]:.3g} ({worst})")
    assert diffs[worst] <= tol, f"{case}: {worst} differs from plain PyTorch by {diffs[worst]:.3g} of its magnitude (tolerance {tol:g}); all: {diffs}"
    if case == "clip_bites":
        assert min(e["grad_norm"] for e in res.of("step")) > 0.05, "the gradient never needed clipping: the case proves nothing"
    if sharded:
        # a sharded final state: one file per shard, and its export is its own full model
        files = s["final"]["state"]["files"]
        assert len(files) == (3 if "cluster.nodes=3" in cfg else 2), files
        out = res.run_dir / "exported.pt"
        assert tools_main(["export", str(res.run_dir), "--out", str(out)], out=io.StringIO()) == 0
        exported = torch.load(out, weights_only=True)
        assert exported.keys() == got.keys() and all(torch.equal(exported[k], got[k]) for k in got)
        # ... and the model the live ranks held: every rank's view, gathered without the state path
        views = _live_views(gather_dir)
        processes = int(s["workers"].split("/")[0])  # the live processes at the end ("2/3 (degraded)" in a shrunk job)
        assert sorted(views) == list(range(processes)), f"{case}: views of ranks {sorted(views)}, {processes} live processes ({s['workers']})"
        params = {n for n, _ in task.build_model().named_parameters()}
        for rank, view in views.items():
            assert view.keys() == exported.keys(), f"{case}: rank {rank}'s view holds {sorted(view)}, the export {sorted(exported)}"
            # parameters are the same on every rank; buffers (BatchNorm statistics) are rank 0's in the state
            differ = [k for k in exported if (k in params or rank == 0) and not torch.equal(view[k], exported[k])]
            assert not differ, f"{case}: the export differs from what live rank {rank} held in {differ}"
        live = plain_loop.max_differences(views[0], want)
        worst = max(live, key=live.get)
        assert live[worst] <= tol, f"{case}: live rank 0's {worst} differs from plain PyTorch by {live[worst]:.3g} of its magnitude (tolerance {tol:g})"
