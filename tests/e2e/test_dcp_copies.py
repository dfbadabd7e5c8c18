"""Every saved state is also a torch.distributed.checkpoint (DCP) checkpoint (issue 30): the
periodic copies of train.save_every (saved/step<S>/dcp) and the emergency copy (state/dcp,
state/emergency-step<S>/dcp) restore with torch's own API alone into a freshly built model and
optimizer, bitwise equal to the job's own copy of that step (read here with torch.load, not by
the export code); ``resume_from`` a DCP folder ends bitwise equal to the fault-free run, and
``export`` reads a DCP folder, beside its copy or moved away.

One job per layout (ddp, zero) makes both kinds of copy: 12 steps, a copy every 4, and the loss
NaN at step 10 (train.on_nonfinite=stop: the emergency copy of step 10, exit 7)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from ckpt_testlib import JobResult, restore_through_dcp, run_job
from ckptless_hpc.config import register_configs
from ckptless_hpc.tools.commands import main as tools_main

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TASKS = Path(__file__).parent / "tasks_for_tests"
ENV = {"PYTHONPATH": str(TASKS)}
BASE = ("~task", "+task._target_=engine_tasks.NanAtStepMLP", "train.steps=12", "cluster.spare_nodes=0")
NAN = ("+task.nan_steps=[10]", "train.save_every=4")  # copies of steps 4 and 8; the emergency copy of step 10
CLEAN = ("+task.nan_steps=[]",)
LAYOUTS = {"ddp": ("parallel=ddp",), "zero": ("parallel=zero",)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The job of a layout, run once for every test of this module."""
    done: Dict[str, JobResult] = {}

    def get(layout: str) -> JobResult:
        if layout not in done:
            res = run_job(tmp_path_factory.mktemp(f"dcp-{layout}"), *BASE, *NAN, *LAYOUTS[layout], env=ENV)
            assert res.rc == 7, res.out[-4000:]
            assert res.summary["saved_state"]["step"] == 10, res.summary
            done[layout] = res
        return done[layout]

    return get


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKS))


def _task(layout: str):
    register_configs()
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        composed = compose(config_name="config", overrides=[*BASE, *CLEAN, *LAYOUTS[layout]])
    return instantiate(composed.task), composed


def _restore(layout: str, path: Path) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    task, cfg = _task(layout)
    model = task.build_model()
    optimizer = task.build_optimizer(model, cfg.optim)
    restore_through_dcp(model, optimizer, path)
    return model, optimizer


def _job_copy(files: List[Path]) -> Tuple[int, Dict[str, torch.Tensor], Dict[Tuple[str, str], object], List[float]]:
    """The job's own copy, read with torch.load alone: its step, the model's tensors by name, the
    optimizer's state by (parameter name, key), the param groups' learning rates."""
    steps, model, optim, lrs = set(), {}, {}, []
    for f in files:
        data = torch.load(f, weights_only=True)
        steps.add(data["meta"]["step"])
        for name, t in data["entries"].items():
            if name.startswith("model."):
                model.setdefault(name[len("model.") :], t)
            elif name.startswith("optim."):
                fqn, _, key = name[len("optim.") :].rpartition(".")
                optim[(fqn, key)] = t
        for name, v in data["meta"]["optim_scalars"].items():
            fqn, _, key = name.rpartition(".")
            optim[(fqn, key)] = v
        lrs = [g["lr"] for g in data["meta"]["param_groups"]]
    assert len(steps) == 1, steps
    return steps.pop(), model, optim, lrs


def _equal(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _check(layout: str, dcp_dir: Path, files: List[Path], step: int) -> Dict[str, torch.Tensor]:
    """The DCP checkpoint at ``dcp_dir`` restores bitwise to the job's copy ``files`` of ``step``."""
    assert json.loads((dcp_dir / "copy.json").read_text())["step"] == step
    want_step, want_model, want_optim, want_lrs = _job_copy(files)
    assert want_step == step
    model, optimizer = _restore(layout, dcp_dir)
    got = model.state_dict()
    assert got.keys() == want_model.keys(), (sorted(got), sorted(want_model))
    assert [k for k in got if not _equal(got[k], want_model[k])] == [], f"{dcp_dir}: model tensors differ from the job's copy of step {step}"
    names = {id(p): n for n, p in model.named_parameters()}
    got_optim = {(names[id(p)], k): v for p, state in optimizer.state.items() for k, v in state.items()}
    assert got_optim.keys() == want_optim.keys(), (sorted(got_optim), sorted(want_optim))
    assert [k for k in got_optim if not _equal(got_optim[k], want_optim[k])] == [], f"{dcp_dir}: optimizer state differs from the job's copy of step {step}"
    assert [g["lr"] for g in optimizer.param_groups] == want_lrs
    return got


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_periodic_and_emergency_copies_restore_through_dcp_load_bitwise(layout, runs):
    res = runs(layout)
    saved = res.run_dir / "saved"
    models = {}
    for step in (4, 8):
        folder = saved / f"step{step}"
        files = [folder / f["file"] for _, f in sorted(json.loads((folder / "index.json").read_text())["files"].items())]
        models[step] = _check(layout, folder / "dcp", files, step)
    emergency = Path(res.summary["saved_state"]["path"])
    if layout == "ddp":
        assert emergency.name == "emergency.pt"
        _check(layout, emergency.parent / "dcp", [emergency], 10)
    else:
        files = sorted(emergency.glob("shard*.pt"))
        assert [f.name for f in files] == ["shard0.pt", "shard1.pt"]
        _check(layout, emergency / "dcp", files, 10)
    assert any(not torch.equal(models[4][k], models[8][k]) for k in models[4]), "steps 4 and 8 hold the same model: the case proves nothing"


def test_resume_from_and_export_read_a_dcp_folder(runs, job, baseline, tmp_path):
    """zero: resume_from=saved/step8/dcp ends bitwise equal to the fault-free run; export of the
    DCP folder equals that of its copy; a DCP folder moved away from its copy is exported from
    the checkpoint itself, and refused by resume_from (it lacks the data order and counters)."""
    res = runs("zero")
    dcp_dir = res.run_dir / "saved" / "step8" / "dcp"
    resumed = job(*BASE, *CLEAN, *LAYOUTS["zero"], f"resume_from={dcp_dir}", env=ENV)
    assert resumed.rc == 0, resumed.out[-4000:]
    assert resumed.summary["resumed_from"]["step"] == 8
    assert [e["step"] for e in resumed.of("step")][0] == 9
    assert resumed.summary["final_state_sha256"] == baseline(*BASE, *CLEAN, *LAYOUTS["zero"], env=ENV)

    def exported(path: Path, out: Path) -> Dict[str, torch.Tensor]:
        assert tools_main(["export", str(path), "--out", str(out)], out=io.StringIO()) == 0
        return torch.load(out, weights_only=True)

    want = exported(dcp_dir.parent, tmp_path / "copy.pt")
    moved = tmp_path / "moved"
    shutil.copytree(dcp_dir, moved)
    for got in (exported(dcp_dir, tmp_path / "dcp.pt"), exported(moved, tmp_path / "moved.pt")):
        assert got.keys() == want.keys() and all(_equal(got[k], want[k]) for k in want)
    from ckptless_hpc.state import export

    with pytest.raises(export.ExportError, match="HINT"):
        export.resume_record(str(moved), 2)
