"""The whole state as a torch.distributed.checkpoint checkpoint (state/dcp.py): a user restores
model and optimizer with torch's own API, without this package, bitwise; from a replicated
state, ZeRO's parts and FSDP2's shards; through ``ckptless-hpc export --format dcp``."""

from __future__ import annotations

import io

import pytest
import torch

from ckpt_testlib import restore_through_dcp
from ckptless_hpc.state import dcp as state_dcp
from ckptless_hpc.state import emergency, export
from ckptless_hpc.state.snapshot import collect_state
from ckptless_hpc.state.views import UserView, model_tensors
from ckptless_hpc.tools.commands import main as tools_main
from ckptless_hpc.train.zero import ZeroPartition
from models.gpt import GPTTask
from models.llama import LlamaTask

pytestmark = pytest.mark.timeout(60)


def _trained(task, steps=2, seed=0):
    torch.manual_seed(seed)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        task.loss(model, task.batch(s, 0, 1, torch.Generator().manual_seed(s))).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _meta(model):
    return {"user_view": UserView.of(model).to_json([n for n, _ in model_tensors(model)])}


def _restore(task, path):
    """What a user does with torch alone (docs/tasks.md)."""
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restore_through_dcp(model, opt, path)
    return model, opt


def _same(a_model, a_opt, b_model, b_opt):
    for (n, x), (_, y) in zip(model_tensors(a_model), model_tensors(b_model)):
        assert torch.equal(x, y), n
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][i][k])), (i, k)
    assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]]


def test_a_replicated_state_with_hooks_restores_through_torchs_own_api(tmp_path):
    task = LlamaTask()
    model, opt = _trained(task)
    shard = collect_state(model, opt, task, 2, _meta(model))
    user = export.full_model([shard], build_model=task.build_model)
    state_dcp.write(str(tmp_path / "dcp"), [shard], user)
    _same(model, opt, *_restore(task, tmp_path / "dcp"))


def test_zeros_parts_merge_into_one_optimizer_state(tmp_path):
    task = GPTTask()
    model, opt = _trained(task)
    zero = ZeroPartition(model, opt, 2, 0)
    shards = []
    for r in (0, 1):
        part = zero._part(r)
        part.optimizer.load_state_dict(_sub_state(opt, part.optimizer, model))
        shards.append(collect_state(model, part.optimizer, task, 2, _meta(model), model_keys=part.model_keys))
    state_dcp.write(str(tmp_path / "dcp"), shards, export.full_model(shards))
    _same(model, opt, *_restore(task, tmp_path / "dcp"))


def _sub_state(full, part, model):
    """The full optimizer's state of the parameters a part steps, as that part's state_dict."""
    index = {id(p): i for i, p in enumerate(p for g in full.param_groups for p in g["params"])}
    sd = full.state_dict()
    mine = [p for g in part.param_groups for p in g["params"]]
    groups = part.state_dict()["param_groups"]
    return {"state": {j: sd["state"][index[id(p)]] for j, p in enumerate(mine) if index[id(p)] in sd["state"]}, "param_groups": groups}


def test_fsdp_shards_join_into_one_state(tmp_path):
    task = GPTTask()
    model, opt = _trained(task)
    names = {id(p): n for n, p in model.named_parameters()}
    shards = []
    for r in range(2):  # what FSDP2's ranks hold: dim-0 chunks of parameters and of their optimizer state
        entries = [(f"param/{n}", p.detach().chunk(2)[r]) for n, p in model.named_parameters()]
        entries += [(f"buffer/{n}", b) for n, b in model.named_buffers()]
        for p, st in opt.state.items():
            entries += [(f"optim/{names[id(p)]}/{k}", v if v.dim() == 0 else v.chunk(2)[r]) for k, v in sorted(st.items())]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        shards.append((entries, {"step": 2, "hyper": hyper, "groups": [[names[id(p)] for p in g["params"]] for g in opt.param_groups], **_meta(model)}))
    state_dcp.write(str(tmp_path / "dcp"), shards, export.full_model(shards))
    _same(model, opt, *_restore(task, tmp_path / "dcp"))


def test_export_format_dcp_of_a_saved_state(tmp_path):
    task = GPTTask()
    model, opt = _trained(task)
    emergency.write(str(tmp_path / "state.pt"), *collect_state(model, opt, task, 2, _meta(model)))
    assert tools_main(["export", str(tmp_path / "state.pt"), "--out", str(tmp_path / "out"), "--format", "dcp"], out=io.StringIO()) == 0
    _same(model, opt, *_restore(task, tmp_path / "out"))


def test_a_workers_copy_gets_its_dcp_checkpoint_once_indexed_and_none_if_never(tmp_path):
    """worker/dcp_copies.py: the writer of shard 0 waits for the copy's index.json, then writes
    dcp/ beside it, presented by a model built beforehand (a fused QKV behind hooks); a copy never
    indexed gets none, and a stop ends the wait at once."""
    import json
    import time

    from ckptless_hpc.worker.dcp_copies import DcpWriter

    task = LlamaTask()
    model, opt = _trained(task)
    folder = tmp_path / "saved" / "step2"
    writer = DcpWriter()
    presenter = task.build_model()
    writer.after_index(str(folder), 2, 30.0, lambda: presenter)
    rec = emergency.write(str(folder / "state.pt"), *collect_state(model, opt, task, 2, _meta(model)))
    time.sleep(0.2)
    assert not (folder / "dcp").exists()  # not before the index
    (folder / "index.json").write_text(json.dumps({"format": 1, "step": 2, "files": {"0": {"file": "state.pt", "state_sha256": rec["sha256"]}}}))
    incomplete = tmp_path / "saved" / "step4"
    writer.after_index(str(incomplete), 4, 30.0)
    t0 = time.monotonic()
    assert writer.finish(30.0) and time.monotonic() - t0 < 10
    _same(model, opt, *_restore(task, folder / "dcp"))
    assert json.loads((folder / "dcp" / "copy.json").read_text())["files"]["0"] == {"file": "../state.pt", "state_sha256": rec["sha256"]}
    assert not (incomplete / "dcp").exists()


def test_a_periodic_copy_pruned_while_its_dcp_checkpoint_is_written_leaves_nothing(tmp_path):
    """CI saw ``saved/step4`` outlive the prune that kept steps 8 and 12: the coordinator deleted
    the copy while the writer of shard 0 was writing its DCP checkpoint, and torch's writer made
    the folder again. Here the prune comes in the middle of that write (from the presenter, which
    copy_to_dcp calls after reading the copy's files and before writing): the folder is gone after."""
    import json

    from ckptless_hpc.coordinator.saved_copies import drop
    from ckptless_hpc.worker.dcp_copies import DcpWriter

    task = LlamaTask()
    model, opt = _trained(task)
    folder = tmp_path / "saved" / "step4"
    rec = emergency.write(str(folder / "state.pt"), *collect_state(model, opt, task, 4, _meta(model)))
    (folder / "index.json").write_text(json.dumps({"format": 1, "step": 4, "files": {"0": {"file": "state.pt", "state_sha256": rec["sha256"]}}}))
    presenter = task.build_model()

    def pruned_meanwhile():
        drop(str(folder))
        return presenter

    writer = DcpWriter()
    writer.after_index(str(folder), 4, 30.0, pruned_meanwhile, what="periodic copy", prunable=True)
    assert writer.finish(30.0)
    assert not folder.exists(), sorted(str(p.relative_to(tmp_path)) for p in folder.rglob("*"))
