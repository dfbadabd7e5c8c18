"""The one-GPU check of the GPU path (issue 12): one command, results as JSON.

    bash tests/gpu/gpu_check.sh [OUT_DIR]          # on a machine with one NVIDIA GPU, < 8 min

What one GPU can prove (NCCL refuses two ranks on one device, so multi-rank runs share the GPU
through gloo on CUDA tensors; tests/gpu/two_gpu_nccl.py needs two GPUs and covers a dead NCCL
peer):

1. oracle_cuda: the training engine on CUDA, 2 ranks sharing the GPU (cluster.comm=gloo), the
   deterministic settings on: a killed worker and a hang end bitwise equal to the fault-free run;
2. oracle_precision: fp16 with GradScaler and bf16 autocast on CUDA, a killed worker each;
3. transfer: the state of the 100M model served from device memory (staged through pinned
   host memory) and fetched into pinned memory then copied to the device, GB/s against the
   device-to-host copy of the same bytes;
4. nccl_regroup: NCCL groups of world size 1 formed, aborted and re-formed 50 times on one
   shared store with the framework's environment: no process abort, GPU memory and threads
   before and after;
5. b1_gpu / b3_gpu: the 100M model on the GPU: a killed worker's downtime (B1) and the steady
   step against plain DDP on the same GPU (B3).

``--device cpu --quick`` runs parts 1-3 and 5 on CPU with tiny sizes: it checks the harness
itself (CI does not run it; a developer can), not the GPU path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import SIZES, median, run_ckptless, task_overrides  # noqa: E402

FAST_HB = ["cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=2"]


def _oracle(tmp: Path, name: str, cfg: List[str], faults: Dict[str, List[str]]) -> Dict[str, Any]:
    base = run_ckptless(tmp / f"{name}-base", cfg)
    out: Dict[str, Any] = {"config": cfg, "baseline_sha256": base.summary["final_state_sha256"], "faults": {}}
    for fname, fcfg in faults.items():
        run = run_ckptless(tmp / f"{name}-{fname}", cfg + fcfg)
        s = run.summary
        out["faults"][fname] = {
            "sha256": s["final_state_sha256"], "bitwise": s["final_state_sha256"] == out["baseline_sha256"], "recoveries": len(s["recoveries"]),
            "downtime_s": [r["downtime_s"] for r in s["recoveries"]],
        }
    out["ok"] = all(f["bitwise"] and f["recoveries"] == 1 for f in out["faults"].values())
    return out


def oracle_cuda(tmp: Path, dev: List[str], size: str) -> Dict[str, Any]:
    cfg = dev + task_overrides(size) + ["train.steps=30", "task.dropout=0.1"] + FAST_HB
    kill = ["fault=kill_worker", "fault.rank=1", "fault.step=10"]
    hang = ["fault=hang", "fault.rank=0", "fault.step=20"]
    return _oracle(tmp, "cuda", cfg, {"kill_rank1": kill, "hang_rank0": hang})


def oracle_precision(tmp: Path, dev: List[str], size: str) -> Dict[str, Any]:
    kill = ["fault=kill_worker", "fault.rank=1", "fault.step=10"]
    out = {}
    for prec in ("fp16", "bf16"):
        cfg = dev + task_overrides(size) + ["train.steps=30", f"train.precision={prec}", "train.clip_grad_norm=1.0"] + FAST_HB
        out[prec] = _oracle(tmp, prec, cfg, {"kill_rank1": kill})
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def transfer(device: str, size: str) -> Dict[str, Any]:
    import torch

    from ckptless_hpc.state.transfer import Arena, StateServer, fetch_state
    from ckptless_hpc.tasks.lm import LMTask

    task = LMTask(**SIZES[size])
    model = task.build_model().to(device)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    from ckptless_hpc.state.snapshot import collect_state

    entries, meta = collect_state(model, opt, task, 0)
    nbytes = sum(t.numel() * t.element_size() for _, t in entries)
    server = StateServer("127.0.0.1", "s" * 32, lambda gen, step, shard=None, **_: (entries, meta))
    arena = Arena(nbytes + (1 << 20), pinned=device == "cuda")
    fetch_s, to_device_s = [], []
    for _ in range(3):
        got = fetch_state("127.0.0.1", server.port, "s" * 32, 0, 0, 120, arena)
        fetch_s.append(got.seconds)
        t0 = time.perf_counter()
        for (_, dst), (_, src) in zip(entries, got.entries):
            dst.copy_(src, non_blocking=True)
        if device == "cuda":
            torch.cuda.synchronize()
        to_device_s.append(time.perf_counter() - t0)
    flat = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device == "cuda")
    d2h = []
    for _ in range(3):
        t0 = time.perf_counter()
        host.copy_(flat, non_blocking=True)
        if device == "cuda":
            torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
    server.close()
    gbs = lambda s: nbytes / median(s) / 1e9  # noqa: E731
    return {
        "bytes": nbytes, "fetch_gb_s": gbs(fetch_s), "host_to_device_gb_s": gbs(to_device_s), "device_to_host_copy_gb_s": gbs(d2h),
        "fetch_vs_d2h_copy": median(d2h) / median(fetch_s),
    }


def nccl_regroup(rounds: int = 50) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ckptless_hpc.train import cuda
    from ckptless_hpc.train.comm import Communicator

    to_set, conflicts = cuda.nccl_environment(os.environ)
    os.environ.update(to_set)
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def snapshot() -> Dict[str, Any]:
        free, total = torch.cuda.mem_get_info()
        return {"threads": threading.active_count(), "os_threads": len(os.listdir("/proc/self/task")), "gpu_used_mb": (total - free) / 2**20,
                "allocated_mb": torch.cuda.memory_allocated() / 2**20}

    x = torch.ones(1 << 20, device=device)
    before = None
    for g in range(rounds):
        comm = Communicator.form(store, g, 0, 1, "127.0.0.1", 30, device, "nccl")
        comm.allreduce(x).wait()
        comm.release(10.0)
        torch.cuda.synchronize()
        if g == 0:
            before = snapshot()
    time.sleep(1.0)  # a dump-key abort would come from the watchdog after its sleep
    after = snapshot()
    return {"rounds": rounds, "env_set": to_set, "env_conflicts": conflicts, "after_first": before, "after_last": after,
            "os_threads_growth": after["os_threads"] - before["os_threads"], "gpu_used_growth_mb": after["gpu_used_mb"] - before["gpu_used_mb"],
            # alive (no dump-key abort) and nothing kept per generation: aborted, not leaked
            "ok": after["os_threads"] - before["os_threads"] <= 2 and after["gpu_used_mb"] - before["gpu_used_mb"] <= 64}


def b1_b3(tmp: Path, dev: List[str], size: str, steps: int, device: str) -> Dict[str, Any]:
    from bench import ckpt_restart

    cfg = dev + task_overrides(size) + FAST_HB + ["cluster.refill_spares=false"]
    kill = run_ckptless(tmp / "b1", cfg + [f"train.steps={steps}", "fault=kill_worker", "fault.rank=1", f"fault.step={steps // 2}"])
    (rec,) = kill.summary["recoveries"]
    steady = run_ckptless(tmp / "b3", cfg + [f"train.steps={steps}"])
    ddp = ckpt_restart.run_baseline(tmp / "b3-ddp", size, 2, steps, 0, [], device=device)
    ck, base = median(steady.step_intervals()), median(ddp.step_intervals())
    return {"size": size, "b1_downtime_s": rec["downtime_s"], "b1_phases": {k: rec[k] for k in ("detect_s", "reconfigure_s", "transfer_s", "resume_s")},
            "b1_bytes": rec["bytes_transferred"], "b3_ckptless_step_s": ck, "b3_ddp_step_s": base, "b3_overhead_pct": 100 * (ck / base - 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(REPO / "bench" / "results"), help="folder for gpu_check.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a check of the harness)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    tmp = out_dir / "gpu_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    dev = [f"cluster.device={args.device}", "cluster.comm=gloo", "cluster.workers_per_node=1", "cluster.nodes=2"]
    small, big = ("tiny", "tiny") if args.quick else ("default", "100M")
    parts: Dict[str, Callable[[], Dict[str, Any]]] = {
        "oracle_cuda": lambda: oracle_cuda(tmp, dev, small),
        "oracle_precision": lambda: oracle_precision(tmp, dev, small),
        "transfer": lambda: transfer(args.device, big),
        "b1_b3": lambda: b1_b3(tmp, dev, big, 20 if args.quick else 40, args.device),
    }
    if args.device == "cuda":
        parts["nccl_regroup"] = nccl_regroup
    results: Dict[str, Any] = {"device": args.device, "quick": args.quick, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch

        results["torch"] = torch.__version__
        if args.device == "cuda":
            results["gpu"] = torch.cuda.get_device_name(0)
            results["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        results["env_error"] = repr(e)
    for name, fn in parts.items():
        t0 = time.monotonic()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - every part reports, the rest still run
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[gpu_check] {name}: {json.dumps(results[name])[:400]}", flush=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {out_dir / 'gpu_check.json'}")
    return 0 if all(results[n].get("ok", True) for n in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
