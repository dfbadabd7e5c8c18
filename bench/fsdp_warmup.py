"""``python -m bench --only fsdp_warmup``: what a hot spare's FSDP2 warm-up buys (docs/sharding.md).

A hot spare of ``parallel=fsdp`` runs a throwaway ``fully_shard`` and step on a private 1-rank
group while it waits (``ckptless_hpc.train.fsdp.warm_up``): the first ``fully_shard`` of a
process pays for torch's lazy imports and first-call set-up, and a spare that takes a rank should
not. Each sample is a fresh process (``python -m bench.fsdp_warmup --one cold|warm``): the first
real ``FSDPBinding.shard`` of a toy model (a linear input layer, 3 blocks of linear + LayerNorm +
dropout, a head) on a 1-rank gloo group, then its first step (forward, backward, clip, Adam), then
``rebind`` to the next generation's group (the first and the median of 20), without (``cold``)
or after (``warm``) the warm-up; cold and warm alternate. Every process also reports the sha256
of its parameters after the first step: the warm-up must leave no trace (equal in every sample).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from .common import REPO

D, H, LAYERS, BATCH, LR, CLIP = 12, 20, 3, 8, 1e-2, 1.0


def _model() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm, self.drop = nn.Linear(H, H), nn.LayerNorm(H), nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(torch.relu(self.norm(self.lin(x))))

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.head = nn.Linear(D, H), nn.ModuleList(Block() for _ in range(LAYERS)), nn.Linear(H, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.inp(x))
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    torch.manual_seed(0)
    return Toy()


def _loss(model: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g)
    torch.manual_seed(7)  # dropout
    return torch.nn.functional.mse_loss(model(x), y)


def _gloo1() -> Any:
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)


def one(mode: str) -> Dict[str, Any]:
    """One sample in this (fresh) process: ``mode`` is ``cold`` or ``warm``."""
    import torch

    from ckptless_hpc.train import fsdp as F

    out: Dict[str, Any] = {"mode": mode, "warm_up": None}
    if mode == "warm":
        out["warm_up"] = F.warm_up(_model, _loss)
    F.stable_default_group(0, 1)
    g0 = F.register_group(_gloo1(), "gen0", [0])
    model = _model()
    t0 = time.perf_counter()
    binding = F.FSDPBinding.shard(model, g0)
    out["shard_s"] = time.perf_counter() - t0
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    t0 = time.perf_counter()
    _loss(model).backward()
    binding.clip(CLIP)
    opt.step()
    out["first_step_s"] = time.perf_counter() - t0
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.full_tensor().detach().contiguous().numpy().tobytes())
    out["params_sha256"] = h.hexdigest()
    g1 = F.register_group(_gloo1(), "gen1", [0])
    times = [binding.rebind(g1) for _ in range(21)]
    out["rebind_first_s"], out["rebind_median_s"] = times[0], statistics.median(times[1:])
    return out


def _sample(mode: str, timeout_s: float = 300) -> Dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "bench.fsdp_warmup", "--one", mode], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"python -m bench.fsdp_warmup --one {mode} exited {p.returncode}: {(p.stdout + p.stderr)[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _spread(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(reps: int) -> Dict[str, Any]:
    """``reps`` fresh processes of each mode, alternated (cold, warm, cold, ...)."""
    samples: Dict[str, List[Dict[str, Any]]] = {"cold": [], "warm": []}
    for _ in range(reps):
        for mode in ("cold", "warm"):
            samples[mode].append(_sample(mode))
    out: Dict[str, Any] = {"reps": reps, "samples": samples, "model_params": sum(p.numel() for p in _model().parameters())}
    for mode, got in samples.items():
        out[mode] = {k: _spread([s[k] for s in got]) for k in ("shard_s", "first_step_s", "rebind_first_s", "rebind_median_s")}
    out["warm"]["warm_up_total_s"] = _spread([s["warm_up"]["total_s"] for s in samples["warm"]])
    out["shard_cold_over_warm"] = out["cold"]["shard_s"]["median"] / out["warm"]["shard_s"]["median"]
    out["same_result"] = len({s["params_sha256"] for m in samples.values() for s in m}) == 1
    return out


def one_line(res: Dict[str, Any]) -> str:
    c, w = res["cold"], res["warm"]
    return (
        f"first fully_shard: cold {1e3 * c['shard_s']['median']:.1f} ms ({1e3 * c['shard_s']['min']:.0f}-{1e3 * c['shard_s']['max']:.0f}), "
        f"warm {1e3 * w['shard_s']['median']:.1f} ms ({1e3 * w['shard_s']['min']:.1f}-{1e3 * w['shard_s']['max']:.1f}): x{res['shard_cold_over_warm']:.0f}; "
        f"warm-up itself {w['warm_up_total_s']['median']:.2f} s; rebind {1e3 * w['rebind_median_s']['median']:.3f} ms; same result: {res['same_result']}"
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp_warmup", description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=("cold", "warm"), help="one sample in this process (prints one JSON line)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.one)))
        return 0
    res = measure(a.reps)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=2))
    print(one_line(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
