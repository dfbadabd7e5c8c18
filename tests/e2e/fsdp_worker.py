"""One rank (or the hot spare) of the FSDP2/HSDP binding tests: trains a small model on gloo over
loopback, on per-generation groups formed on a TCP store, and can SIGKILL itself mid-backward.

    python fsdp_worker.py '<json spec>'

spec: mode (fsdp|hsdp|ddp), role (rank|spare), rank, world, shard_size, steps, accum, port, dir,
kill ({"rank", "step", "micro", "phase": backward|forward} or null). Writes into dir: own_<rank>.pt (the committed local
state after each step, when a kill is planned), final_<rank>.pt (own entries at the end),
full.pt (rank 0: the gathered parameters), stats_<rank>.json (timings).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ckptless_hpc.train import fsdp as F  # noqa: E402
from ckptless_hpc.train.comm import Communicator  # noqa: E402

D, H, LAYERS, BATCH, LR, CLIP = 12, 20, 3, 8, 1e-2, 1.0
HOST, TIMEOUT_S = "127.0.0.1", 30.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("scale", torch.full((H,), 0.5))  # a buffer inside an FSDP unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.norm(self.lin(x)))) * self.scale


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, H)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(H, 1)  # 1 row over 3 ranks: ranks 1 and 2 hold empty shards
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))  # changed by every forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build() -> Toy:
    torch.manual_seed(0)
    return Toy()


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100_000 + step * 1000 + rank * 10 + micro)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g)


def dropout_seed(step: int, rank: int, micro: int) -> None:
    torch.manual_seed(7 + step * 1000 + rank * 10 + micro)


def loss_of(model: nn.Module, step: int, rank: int, micro: int) -> torch.Tensor:
    x, y = batch(step, rank, micro)
    dropout_seed(step, rank, micro)
    return nn.functional.mse_loss(model(x), y)


def reference(world: int, steps: int, accum: int) -> dict:
    """The same training in one process, without any sharding: the global batch's mean loss."""
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            for m in range(accum):
                (loss_of(model, step, r, m) / (world * accum)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Rank:
    def __init__(self, spec: dict, store: dist.Store) -> None:
        self.spec, self.store = spec, store
        self.rank, self.world, self.mode = spec["rank"], spec["world"], spec["mode"]
        self.dir = Path(spec["dir"])
        self.stats: dict = {"step_s": []}
        self.gen_objs: list = []  # the current generation's groups

    # ---- groups
    def groups(self, gen: int):
        """Generation ``gen``'s groups, formed and registered; self.gen_objs holds them (and only it)."""
        t0 = time.perf_counter()
        comm = Communicator.form(self.store, gen, self.rank, self.world, HOST, TIMEOUT_S, torch.device("cpu"), "gloo")
        world_pg = F.register_group(comm)
        self.gen_objs = [comm, world_pg]
        out = (world_pg, None)
        if self.mode == "hsdp":
            hs = F.form_hsdp_groups(self.store, gen, self.rank, self.world, self.spec["shard_size"], HOST, TIMEOUT_S)
            self.gen_objs += hs.groups()
            out = (hs.shard, hs.replicate)
        self.stats.setdefault("form_s", []).append(time.perf_counter() - t0)
        return out

    def setup(self, gen: int) -> None:
        F.stable_default_group(self.rank, self.world)
        self.model = build()
        shard_pg, rep_pg = self.groups(gen)
        t0 = time.perf_counter()
        if self.mode == "ddp":
            self.binding, self.group = None, shard_pg
        else:
            kw = {}
            if self.spec.get("precision") == "fp16":  # fp16 compute, fp32 reduction and master weights
                from torch.distributed.fsdp import MixedPrecisionPolicy

                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
            self.binding = F.FSDPBinding.shard(self.model, shard_pg, rep_pg, **kw)
        self.scaler = torch.amp.GradScaler("cpu") if self.spec.get("precision") == "fp16" else None
        self.stats["shard_s"] = time.perf_counter() - t0
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)  # built on the sharded parameters

    # ---- one step
    def step(self, step: int) -> None:
        kill = self.spec.get("kill")
        accum = self.spec["accum"]
        self.opt.zero_grad(set_to_none=True)
        for m in range(accum):
            if self.binding is not None:
                self.binding.set_sync(m == accum - 1)
            here = kill and (kill["rank"], kill["step"], kill["micro"]) == (self.rank, step, m) and self.spec["role"] == "rank"
            if here and kill.get("phase") == "forward":  # dies inside the forward, between two units
                self.model.blocks[1].register_forward_pre_hook(lambda mod, args: os.kill(os.getpid(), signal.SIGKILL))
            loss = loss_of(self.model, step, self.rank, m) / accum
            if here and kill.get("phase", "backward") == "backward":
                loss.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))  # dies as backward starts
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.binding is None:  # the plain data-parallel equivalent: one flat allreduce
            grads = [p.grad for p in self.model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        elif self.scaler is not None:
            inject = self.spec.get("inf_at")
            if inject and inject == [self.rank, step]:  # an overflow in this rank's shard only
                next(self.model.parameters()).grad.to_local().view(-1)[0] = float("inf")
            self.scaler.unscale_(self.opt)  # DTensor reduces its inf flag (max) over the mesh's group
            self.binding.clip(CLIP)
            scale = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.scaler.get_scale() < scale:
                self.stats.setdefault("skipped", []).append(step)
            return
        else:
            self.binding.clip(CLIP)
        self.opt.step()

    def save_committed(self, step: int) -> None:
        entries = [(n, t.clone()) for n, t in F.own_entries(self.model, self.opt)]
        tmp = self.dir / f".own_{self.rank}.pt"
        torch.save({"step": step, "entries": entries}, tmp)
        os.replace(tmp, self.dir / f"own_{self.rank}.pt")

    def train(self, start: int, gen: int) -> None:
        kill = self.spec.get("kill")
        step = start
        while step < self.spec["steps"]:
            calls = self.model.calls.clone()
            t0 = time.perf_counter()
            failed = None
            try:
                self.step(step)
            except Exception as e:  # a peer died: discard the step, next generation, redo it
                failed = str(e)[:200]
            if failed is not None:
                self.stats["error"] = failed
                t1 = time.perf_counter()
                self.binding.reset()
                self.model.calls.copy_(calls)  # the failed forward counted: put the buffer back
                objs, self.gen_objs = self.gen_objs + self.binding.unbind(), []
                F.release_in_background(objs)  # releases peers blocked on this rank (HSDP)
                del objs
                self.store.set("failed", str(step))
                gen += 1
                self.stats["rebind_s"] = self.binding.rebind(*self.groups(gen))  # no local keeps a group alive
                self.stats["recover_s"] = time.perf_counter() - t1
                self.serve(kill)
                continue
            self.stats["step_s"].append(time.perf_counter() - t0)
            if kill and kill["rank"] == self.rank and self.mode != "hsdp":  # FSDP: the stand-in for a buddy copy
                self.save_committed(step)
            step += 1
        self.finish()

    def serve(self, kill: dict) -> None:
        """HSDP: the rank with the dead rank's shard index in another replica serves its entries."""
        if self.mode != "hsdp":
            return
        s = self.spec["shard_size"]
        dead = kill["rank"]
        peer = next(r for r in range(dead % s, self.world, s) if r != dead)
        if self.rank == peer:
            tmp = self.dir / ".serve.pt"
            torch.save({"entries": [(n, t.clone()) for n, t in F.own_entries(self.model, self.opt)]}, tmp)
            os.replace(tmp, self.dir / f"serve_{dead}.pt")
            self.store.set("served", "1")

    def finish(self) -> None:
        entries = [(n, t.clone()) for n, t in F.own_entries(self.model, self.opt)]
        torch.save(entries, self.dir / f"final_{self.rank}.pt")
        if self.binding is not None:  # a collective over the CURRENT generation (mesh re-bound)
            full = {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
        else:
            full = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        if self.rank == 0:
            torch.save(full, self.dir / "full.pt")
        (self.dir / f"stats_{self.rank}.json").write_text(json.dumps(self.stats))


def run_spare(spec: dict, store: dist.Store) -> None:
    dead = spec["kill"]["rank"]
    stats = {"warm_up": F.warm_up(build, lambda m: loss_of(m, 0, 0, 0))}
    store.set("spare_ready", "1")
    store.wait(["failed"])
    spec = dict(spec, rank=dead)
    w = Rank(spec, store)
    w.stats.update(stats)
    w.setup(1)  # its first real fully_shard, on generation 1's group
    t0 = time.perf_counter()
    if spec["mode"] == "hsdp":  # the same shard index of another replica, served live: no copy
        store.wait(["served"])
        src = torch.load(Path(spec["dir"]) / f"serve_{dead}.pt")
        start = int(store.get("failed"))
    else:  # the dead rank's own committed entries (the test's stand-in for a buddy copy)
        src = torch.load(Path(spec["dir"]) / f"own_{dead}.pt")
        start = src["step"] + 1
    F.load_own(w.model, w.opt, src["entries"])
    w.stats["load_s"] = time.perf_counter() - t0
    w.train(start, 1)


def main() -> None:
    spec = json.loads(sys.argv[1])
    store = dist.TCPStore(HOST, spec["port"], is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
    if spec["role"] == "spare":
        run_spare(spec, store)
    else:
        if spec.get("kill"):
            store.wait(["spare_ready"])  # a hot spare is warm before the job starts
        w = Rank(spec, store)
        w.setup(0)
        w.train(0, 0)
    sys.stdout.flush()
    os._exit(0)  # a broken generation's gloo threads must not hold the interpreter at exit


if __name__ == "__main__":
    main()
