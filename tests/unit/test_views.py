"""The two views of a model's state (state/views.py) on the zoo's models (tests/models/): inside
the job the tensors themselves (a fused parameter, not the copies its hooks present; a tie once;
any dtype), for a user the model's own state_dict() (hooks run, ties equal, no non-persistent
buffer). Each failure of issue 30 that a view caused has its case here."""

from __future__ import annotations

import io

import pytest
import torch

from ckptless_hpc.state import emergency, export
from ckptless_hpc.state.snapshot import apply_state, collect_state, state_sha256
from ckptless_hpc.state.views import UserView, model_tensors, present
from ckptless_hpc.tools.commands import main as tools_main
from ckptless_hpc.train.zero import ZeroPartition, partition
from models.cnn import CNNTask
from models.counters import CountersTask
from models.gpt import GPTTask
from models.llama import LlamaTask

pytestmark = pytest.mark.timeout(60)

ZOO = {"llama": LlamaTask, "gpt": GPTTask, "cnn": CNNTask, "counters": CountersTask}


def _trained(task, steps: int = 2, seed: int = 0):
    """A model and AdamW after ``steps`` steps (every tensor off its init, buffers moved)."""
    torch.manual_seed(seed)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        task.loss(model, task.batch(s, 0, 1, torch.Generator().manual_seed(s))).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _view_json(model):
    return UserView.of(model).to_json([n for n, _ in model_tensors(model)])


def test_the_jobs_view_is_the_tensors_themselves():
    llama = LlamaTask().build_model()
    names = dict(model_tensors(llama))
    assert "layers.0.attention.wqkv.weight" in names and "layers.0.attention.wq.weight" not in names
    assert names["freqs_cis"].dtype == torch.complex64  # non-persistent, carried all the same
    assert names["layers.0.attention.wqkv.weight"] is llama.layers["0"].attention.wqkv.weight  # the tensor, not a copy
    gpt = GPTTask().build_model()
    names = [n for n, _ in model_tensors(gpt)]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # the tie once
    assert "transformer.h.0.attn.bias" in names


def test_the_users_view_is_the_models_own_state_dict():
    llama_view = UserView.of(LlamaTask().build_model())
    assert set(llama_view.renamed) == {f"layers.{i}.attention.{w}.weight" for i in (0, 1) for w in ("wq", "wk", "wv")}
    assert "freqs_cis" not in llama_view.keys
    gpt = GPTTask().build_model()
    view = UserView.of(gpt)
    assert view.keys["lm_head.weight"] == "transformer.wte.weight" and not view.renamed
    compact = view.to_json([n for n, _ in model_tensors(gpt)])
    assert compact["aliases"] == {"lm_head.weight": "transformer.wte.weight"} and "transformer.h.1.attn.bias" in compact["hidden"]
    assert UserView.from_json(compact, [n for n, _ in model_tensors(gpt)]).keys == view.keys


@pytest.mark.parametrize("name", list(ZOO))
def test_presented_state_loads_strictly_and_equals_the_models_state_dict(name):
    task = ZOO[name]()
    model, _ = _trained(task)
    got = present(dict(model_tensors(model)), UserView.of(model), task.build_model)
    want = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    fresh = task.build_model()
    fresh.load_state_dict(got)  # strict
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(model_tensors(fresh), model_tensors(model)) if not a.is_complex())


@pytest.mark.parametrize("name", list(ZOO))
def test_a_state_round_trips_bitwise_through_the_jobs_view(name):
    task = ZOO[name]()
    model, opt = _trained(task, steps=2)
    entries, meta = collect_state(model, opt, task, 2, {"user_view": _view_json(model)})
    snap = [(n, t.clone()) for n, t in entries]
    other, other_opt = _trained(task, steps=3, seed=5)  # another state of the same model: overwritten whole
    apply_state(other, other_opt, task, snap, meta)
    assert state_sha256(*collect_state(other, other_opt, task, 2, {"user_view": _view_json(other)})) == state_sha256(entries, meta)


def test_zero_rolls_back_a_fused_qkv_parameter():
    """Failure 1: ZeRO's shard named the keys the hooks present (wq/wk/wv) and missed the fused
    parameter: the rollback refused ("missing wqkv") and the job ended no_spare."""
    task = LlamaTask()
    model, opt = _trained(task, steps=1)
    zero = ZeroPartition(model, opt, 2, 0)
    for r in (0, 1):
        part = zero._part(r)
        assert not any(k.endswith((".wq.weight", ".wk.weight", ".wv.weight")) for k in part.model_keys)
    part = zero.own
    before = collect_state(model, part.optimizer, task, 1, model_keys=part.model_keys)
    snap = [(n, t.clone()) for n, t in before[0]]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the update the rollback undoes
    apply_state(model, part.optimizer, task, snap, before[1], model_keys=part.model_keys)
    after = collect_state(model, part.optimizer, task, 1, model_keys=part.model_keys)
    assert state_sha256(*after) == state_sha256(snap, before[1])


def test_zero_shards_hold_a_tie_once_and_the_export_shows_it_equal_to_its_tensor(tmp_path):
    """Failure 4: the alias of a tie was classed a buffer, every shard saved it, and the export
    kept shard 0's, one step stale when rank 0 does not own the tied tensor."""
    task = GPTTask()
    model, opt = _trained(task, steps=2)
    named = [(n, p) for n, p in model.named_parameters()]
    owner = dict(zip([n for n, _ in named], partition([p.numel() for _, p in named], 2)))
    assert owner["transformer.wte.weight"] == 1, "the case needs the tied tensor on rank 1 (the failure's condition)"
    zero = ZeroPartition(model, opt, 2, 0)
    for r in (0, 1):
        part = zero._part(r)
        entries, meta = collect_state(model, part.optimizer, task, 2, {"user_view": _view_json(model)}, model_keys=part.model_keys)
        assert "model.lm_head.weight" not in dict(entries)
        if r == 0:  # rank 0 holds a stale copy of every parameter it does not own
            entries = [(n, t + 1.0 if t.is_floating_point() and n[len("model.") :] not in part.model_keys else t) for n, t in entries]
        emergency.write(str(tmp_path / f"shard{r}.pt"), entries, meta)
    got = export.load_full_model(str(tmp_path))
    assert torch.equal(got["lm_head.weight"], model.transformer.wte.weight) and torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])
    assert got.keys() == model.state_dict().keys()  # no non-persistent buffer (failure 5)
    task.build_model().load_state_dict(got)


def test_export_of_a_final_state_without_its_index_and_of_a_hooked_model(tmp_path):
    """Failure 5: "no saved state" for final/state/ with shard files and no index.json; and a
    model whose hooks rename keys is presented by the run's own task."""
    task = LlamaTask()
    model, opt = _trained(task)
    state = tmp_path / "run" / "final" / "state"
    entries, meta = collect_state(model, opt, task, 2, {"user_view": _view_json(model)})
    emergency.write(str(state / "shard0.pt"), entries, meta)
    with pytest.raises(export.ExportError, match="hook"):
        export.load_full_model(str(tmp_path / "run"))  # no model to present the renamed keys with
    got = export.load_full_model(str(tmp_path / "run"), build_model=task.build_model)
    want = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # the CLI finds the task in the run's config
    hydra = tmp_path / "run" / ".hydra"
    hydra.mkdir()
    (hydra / "config.yaml").write_text("task:\n  _target_: models.llama.LlamaTask\n")
    out = tmp_path / "m.pt"
    assert tools_main(["export", str(tmp_path / "run"), "--out", str(out)], out=io.StringIO()) == 0
    task.build_model().load_state_dict(torch.load(out, weights_only=True))


def test_a_copy_of_todays_format_still_loads_and_exports(tmp_path):
    """Copies written before the views (state_dict() keys, no "view" in meta) are read as written."""
    task = GPTTask()
    model, opt = _trained(task)
    sd = opt.state_dict()
    entries = [(f"model.{k}", v) for k, v in model.state_dict().items()]
    entries += [(f"optim.{i}.{k}", v) for i in sorted(sd["state"]) for k, v in sorted(sd["state"][i].items())]
    meta = {"step": 2, "param_groups": sd["param_groups"], "optim_scalars": {}, "task_scalars": {}}
    emergency.write(str(tmp_path / "state.pt"), entries, meta)
    got = export.load_full_model(str(tmp_path / "state.pt"))
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    fresh, fresh_opt = _trained(task, steps=3, seed=9)
    apply_state(fresh, fresh_opt, task, *emergency.read(str(tmp_path / "state.pt")))
    assert torch.equal(fresh.transformer.wte.weight, model.transformer.wte.weight)


def test_export_as_safetensors_loads_into_the_model(tmp_path):
    """``ckptless-hpc export --format safetensors`` (or an --out ending in .safetensors): the tie
    as two tensors of its own (safetensors refuses shared storage), loadable strictly."""
    from safetensors.torch import load_file

    task = GPTTask()
    model, opt = _trained(task)
    emergency.write(str(tmp_path / "state.pt"), *collect_state(model, opt, task, 2, {"user_view": _view_json(model)}))
    out = tmp_path / "model.safetensors"
    assert tools_main(["export", str(tmp_path / "state.pt"), "--out", str(out)], out=io.StringIO()) == 0
    got = load_file(str(out))
    want = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    task.build_model().load_state_dict(got)
    assert tools_main(["export", str(tmp_path / "state.pt"), "--out", str(tmp_path / "m.bin"), "--format", "safetensors"], out=io.StringIO()) == 0
    assert load_file(str(tmp_path / "m.bin")).keys() == want.keys()
