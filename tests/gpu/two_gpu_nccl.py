"""The two-GPU check of the NCCL path (issue 12): a dead or hung NCCL peer mid-allreduce.

    python3 tests/gpu/two_gpu_nccl.py [OUT_DIR]        # needs 2 NVIDIA GPUs; writes two_gpu_nccl.json

UNTESTED: no machine with two GPUs has run it yet (docs/gpu.md says so). It runs real jobs,
one rank per GPU over NCCL (cluster=local, one node of 2 ranks, a spare node whose worker i
uses GPU i), and checks that a killed rank 0 and a hung rank 0 (SIGSTOP: its communicator is
not torn down by the kernel) release the survivor within cluster.abort_timeout_s plus the
detection bound, and that each run ends bitwise equal to the fault-free one. Rank 0 is the
one to fail because the first spare worker (local index 0) uses GPU 0: the GPU the dead rank
leaves free.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import run_ckptless, task_overrides  # noqa: E402

CFG = [
    "cluster.device=cuda", "cluster.comm=nccl", "cluster.nodes=1", "cluster.workers_per_node=2", "cluster.gpus_per_node=2",
    "cluster.abort_timeout_s=10", "cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=2", "train.steps=40",
    *task_overrides("default"),
]
FAULTS = {
    "kill_rank0": ["fault=kill_worker", "fault.rank=0", "fault.step=10"],
    "hang_rank0": ["fault=hang", "fault.rank=0", "fault.step=20"],
}


def main() -> int:
    import torch

    if torch.cuda.device_count() < 2:
        print("two_gpu_nccl: needs 2 GPUs; this machine has", torch.cuda.device_count())
        return 2
    out = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "bench" / "results")
    tmp = out / "gpu2_tmp"
    base = run_ckptless(tmp / "base", CFG)
    res = {"config": CFG, "baseline_sha256": base.summary["final_state_sha256"], "faults": {}}
    for name, f in FAULTS.items():
        s = run_ckptless(tmp / name, CFG + f).summary
        (rec,) = s["recoveries"]
        res["faults"][name] = {"bitwise": s["final_state_sha256"] == res["baseline_sha256"], "downtime_s": rec["downtime_s"],
                               "reconfigure_s": rec["reconfigure_s"], "detect_s": rec["detect_s"]}
    res["ok"] = all(v["bitwise"] for v in res["faults"].values())
    (out / "two_gpu_nccl.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
