"""Single-process checks of the FSDP2 binding, each run in a fresh process by
test_fsdp_binding.py (the default group is process-wide: never made in the pytest process).

    python fsdp_single.py <check>     prints one JSON line: what the check measured
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fsdp_worker as W  # noqa: E402
from ckptless_hpc.train import fsdp as F  # noqa: E402
from ckptless_hpc.train import torch_private as P  # noqa: E402


def _gloo1():
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)


def _loss(m):
    return W.loss_of(m, 0, 0, 0)


def default_group() -> dict:
    out = {}
    F.stable_default_group(2, 3)
    F.stable_default_group(2, 3)  # idempotent
    out["rank"], out["world"] = dist.get_rank(), dist.get_world_size()
    for what, fn in {"other_rank": lambda: F.stable_default_group(1, 3), "collective": lambda: dist.all_reduce(torch.ones(1)),
                     "barrier": dist.barrier}.items():
        try:
            fn()
            out[what] = "no error"
        except RuntimeError as e:
            out[what] = str(e)
    return out


def rebind_and_state() -> dict:
    """1 rank: train, re-bind to a new group (timed), full_tensor follows; own_entries ->
    load_own into a fresh model + fresh optimizer continues bitwise like the original."""
    F.stable_default_group(0, 1)
    g0 = F.register_group(_gloo1(), "gen0", [0])
    a = W.build()
    ba = F.FSDPBinding.shard(a, g0)
    oa = torch.optim.Adam(a.parameters(), lr=W.LR)

    def step(m, b, o, s):
        o.zero_grad(set_to_none=True)
        W.loss_of(m, s, 0, 0).backward()
        b.clip(W.CLIP)
        o.step()

    for s in range(3):
        step(a, ba, oa, s)
    g1 = F.register_group(_gloo1(), "gen1", [0])
    objs = [g0] + ba.unbind()
    times = []
    del g0
    F.release_in_background(objs)
    times.append(ba.rebind(g1))
    times += [ba.rebind(g1) for _ in range(20)]
    groups_used = {ba.mesh.get_group().group_name}
    full = {n: p.full_tensor() for n, p in a.named_parameters()}  # a collective on gen1
    b_model = W.build()
    with torch.no_grad():  # make it differ: load_own must overwrite everything
        for p in b_model.parameters():
            p.add_(1.0)
    bb = F.FSDPBinding.shard(b_model, g1)
    ob = torch.optim.Adam(b_model.parameters(), lr=W.LR)  # fresh: no state yet
    ents = [(n, t.clone()) for n, t in F.own_entries(a, oa)]
    F.load_own(b_model, ob, ents)
    ptrs_ok = all(p.to_local().data_ptr() == p._local_tensor.data_ptr() for p in b_model.parameters())
    for s in range(3, 6):
        step(a, ba, oa, s)
        step(b_model, bb, ob, s)
    ea, eb = F.own_entries(a, oa), F.own_entries(b_model, ob)
    errors = {}
    before = [t.clone() for _, t in F.own_entries(b_model, ob)]
    for what, ents_bad in {"missing": ents[1:], "unknown": ents + [("param/nope", torch.zeros(1))],
                           "shape": [(n, t + 1 if n != "param/inp.weight" else t[:1]) for n, t in ents]}.items():
        try:
            F.load_own(b_model, ob, ents_bad)
            errors[what] = "no error"
        except ValueError as e:
            errors[what] = str(e)
    return {
        "rebind_first_s": times[0], "rebind_median_s": sorted(times)[len(times) // 2], "group": sorted(groups_used),
        "registered_gen0": P.registered("gen0"), "full_ok": all(torch.equal(full[n], p.to_local()) for n, p in a.named_parameters()),
        "names": [n for n, _ in ea], "bitwise": [n for (n, x), (_, y) in zip(ea, eb) if not torch.equal(x, y)],
        "same_names": [n for n, _ in ea] == [n for n, _ in eb], "ptrs_ok": ptrs_ok, "errors": errors,
        "contiguous": all(t.is_contiguous() for _, t in ea),
        "unchanged_after_refusals": all(torch.equal(x, y) for x, (_, y) in zip(before, F.own_entries(b_model, ob))),
        "optim_dtensor": sorted({type(v).__name__ for st in ob.state.values() for v in st.values()}),
    }


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def units() -> dict:
    """Default units: the Toy's children, its ModuleList opened; tied weights stay with the root."""
    def named(model):
        names = {id(m): n for n, m in model.named_modules()}
        return [names[id(u)] for u in F.default_units(model)]

    F.stable_default_group(0, 1)
    pg = F.register_group(_gloo1(), "gen0", [0])
    tied = Tied()
    before = named(tied)
    b = F.FSDPBinding.shard(tied, pg)
    opt = torch.optim.Adam(tied.parameters(), lr=1e-2)
    tied(torch.arange(6)).sum().backward()
    b.clip(1.0)
    opt.step()
    return {"tied": before, "toy": named(W.build()), "tied_kept": tied.head.weight is tied.emb.weight,
            "entries": [n for n, _ in F.own_entries(tied, opt) if n.startswith("param/")]}


def version_check() -> dict:
    torch.__version__ = "2.99.0"
    try:
        P.check()
        return {"error": "no error"}
    except RuntimeError as e:
        return {"error": str(e)}


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()), flush=True)
    import os

    os._exit(0)
