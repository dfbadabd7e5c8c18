"""The full model of a saved state (state/export.py): from one file, from ZeRO's and FSDP2's
shards, through a key map (tied parameters, non-persistent buffers), from every kind of path;
refusals that name the path."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

from ckptless_hpc.state import emergency, export
from ckptless_hpc.state.snapshot import collect_state
from ckptless_hpc.state.views import UserView, model_tensors
from ckptless_hpc.tasks.mlp import MLPTask
from ckptless_hpc.tools.commands import main as tools_main

pytestmark = pytest.mark.timeout(60)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied: two keys, one parameter
        self.register_buffer("scratch", torch.zeros(3), persistent=False)  # not in state_dict()


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = Tied()
    with torch.no_grad():
        m.norm.running_mean.uniform_()
    return m


def _fsdp_shards(model: nn.Module, world: int):
    """What FSDP2's ranks save (train/fsdp.own_entries): each parameter's dim-0 chunk, buffers whole."""
    shards = []
    for r in range(world):
        entries = [(f"param/{n}", p.detach().chunk(world)[r] if r < len(p.detach().chunk(world)) else p.detach()[:0]) for n, p in model.named_parameters()]
        entries += [(f"buffer/{n}", b) for n, b in model.named_buffers()]
        shards.append((entries, {"step": 3, "user_view": UserView.of(model).to_json([n for n, _ in model_tensors(model)])}))
    return shards


def test_fsdp_shards_join_to_the_full_state_dict_through_the_user_view():
    model = _model()
    got = export.full_model(_fsdp_shards(model, 3), view=UserView.of(model))
    want = model.state_dict()
    assert list(got) == list(want)  # tied alias present, non-persistent buffer absent
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh = Tied()
    fresh.load_state_dict(got)  # strict
    assert torch.equal(fresh.head.weight, model.emb.weight)


def test_zero_shards_are_disjoint_parameters_and_the_same_buffers(tmp_path):
    task = MLPTask()
    torch.manual_seed(1)
    model = task.build_model()
    opt = task.build_optimizer(model, type("O", (), {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0})())
    names = [n for n, _ in model.named_parameters()]
    files = []
    for r in range(2):
        entries, meta = collect_state(model, opt, task, 5, model_keys=set(names[r::2]))
        path = tmp_path / f"shard{r}.pt"
        emergency.write(str(path), entries, meta)
        files.append(str(path))
    got = export.load_full_model(str(tmp_path))
    assert got.keys() == model.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    # the CLI writes the same, loadable into a fresh build_model()
    out = io.StringIO()
    assert tools_main(["export", str(tmp_path), "--out", str(tmp_path / "m.pt")], out=out) == 0
    task.build_model().load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    assert "sha256" in out.getvalue()


def test_a_missing_shard_is_refused_with_the_path_and_a_hint(tmp_path):
    model = _model()
    shards = _fsdp_shards(model, 2)
    for r in (0, 2):  # shard 1 lost
        emergency.write(str(tmp_path / f"shard{r}.pt"), *shards[0])
    with pytest.raises(export.ExportError, match=r"holds shards \[0, 2\].*HINT"):
        export.load_full_model(str(tmp_path))
    with pytest.raises(export.ExportError, match="lacks 1 tensor"):
        export.full_model([([e for e in shards[0][0] if e[0] != "param/norm.bias"], {})], view=UserView.of(model))


def test_paths_a_user_gives(tmp_path):
    model = _model()
    run = tmp_path / "run"
    state = run / "final" / "state"
    state.mkdir(parents=True)
    for r, sh in enumerate(_fsdp_shards(model, 2)):
        emergency.write(str(state / f"shard{r}.pt"), *sh)
    rec = export.write_final(str(state), [str(state / "shard0.pt"), str(state / "shard1.pt")], str(run / "final" / "model.pt"), 3, "fsdp", UserView.of(model))
    index = json.loads((state / "index.json").read_text())
    assert index["model"]["sha256"] == rec["model"]["sha256"] == export.file_sha256(str(run / "final" / "model.pt"))
    assert all(index["files"][k]["sha256"] == export.file_sha256(str(state / v["file"])) for k, v in index["files"].items())
    want = torch.load(run / "final" / "model.pt", weights_only=True)
    for p in (run, run / "final", state):  # a run dir, its final/, the state folder
        got = export.load_full_model(str(p))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), p
    with pytest.raises(export.ExportError, match="does not exist"):
        export.load_full_model(str(tmp_path / "nowhere"))
    with pytest.raises(export.ExportError, match="no saved state"):
        export.load_full_model(str(tmp_path))
    (state / "shard1.pt").write_bytes(b"garbage")
    with pytest.raises(export.ExportError, match="damaged"):
        export.load_full_model(str(run))
