"""What each mode runs: sizes, steps, fault steps, repetitions (one place to read and change).

``quick`` is the CI smoke: tiny sizes, one repetition, a few minutes at most on 2 cores; its
numbers only prove that the harness works. ``full`` is the run quoted in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class B1Point:
    size: str
    steps: int  # ckptless job length
    fault_step: int  # ckptless: the step during which rank 1 is killed / hung
    ckpt_every: int  # baseline: checkpoint interval K (steps); the kill comes K/2 steps after a checkpoint
    reps: int = 1

    @property
    def base_fault_step(self) -> int:
        return 2 * self.ckpt_every + self.ckpt_every // 2

    @property
    def base_steps(self) -> int:
        return self.base_fault_step + self.ckpt_every // 2 + 2


@dataclass(frozen=True)
class Plan:
    name: str
    b1: List[B1Point]
    b2_size: str
    b2_steps: int
    b2_fault_step: int
    b2_reps: int
    b2_required: bool  # True: no torchft (or no ratio) fails the run (the full run); False: B2 is skipped without it
    b3_size: str
    b3_steps: int
    b3_reps: int
    b3_torchft: bool  # also time TorchFT's steady state in B3 (else B2 uses its kill run's steps before the kill)
    b4_bytes: int
    b4_reps: int
    # the real-process recovery at a few workers (b5_nodes): what `--only gloo_lazy` compares (B5 was
    # this until it measured the 2 cores' share more than the design: bench/b5.py)
    b5_size: str
    b5_nodes: Tuple[int, ...]
    b5_steps: int
    b5_fault_step: int
    b5_reps: int
    b6_size: str
    b6_interval_s: float  # mean (here: fixed) time between failures
    b6_failures: int
    sim_gpus: Tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)
    b7_ranks: Tuple[int, ...] = (1000, 4000, 10000)  # simulated ranks (bench/b7.py)
    b7_wpn: int = 8  # ranks per simulated node
    b7_steady_s: float = 20.0  # the window in which CPU and heartbeat delay are measured
    b7_controls: Tuple[str, ...] = ("node", "rank")  # cluster.control: each world size with relays (one connection per node) and without
    b8_size: str = "tiny"  # B8 (bench/b8.py): sharded state
    b8_steps: int = 30
    b8_reps: int = 1
    b8_factors: Tuple[int, ...] = (1,)  # 1: 2 nodes; 2: 3 nodes (a copy lives on another node)
    b8_modes: Tuple[str, ...] = ("zero",)
    b8_modes_available: Tuple[str, ...] = ("zero",)
    b8_recover_sizes: Tuple[str, ...] = ("tiny",)
    b8_recover_steps: int = 20
    # B1 on the Slurm mini-cluster (bench/slurm_path.py; root only): a crashed node and a killed
    # step, each b1_slurm_reps times, next to the local killed worker; 0 reps: not in this mode
    b1_slurm_size: str = "default"
    b1_slurm_steps: int = 200
    b1_slurm_fault_step: int = 60
    b1_slurm_reps: int = 0
    # B9 (bench/b9.py): elastic. The fixed-order reduction's overhead over allreduce on 4 ranks
    # (2 nodes x 2 workers), b9_reps back-to-back pairs of b9_steps steps; shrinks: (nodes,
    # min_nodes) points, each losing its last node at b9_fault_step of b9_shrink_steps with no
    # spare (the first also with a spare to promote, b9_shrink_reps times, interleaved)
    b9_size: str = "tiny"
    b9_steps: int = 40
    b9_reps: int = 1
    b9_shrinks: Tuple[Tuple[int, int], ...] = ((2, 1),)
    b9_shrink_steps: int = 30
    b9_fault_step: int = 15
    b9_shrink_reps: int = 1
    b9_skip: int = 3  # warm-up intervals left out (and before the shrink)
    b9_post_skip: int = 2  # intervals left out after the shrink's first step
    # grow back (the first shrink point, refill allowed), for each of b9_grow_modes, b9_grow_reps
    # times: the shrink's and the grow-back's downtime; 0 reps: not in this mode
    b9_grow_modes: Tuple[str, ...] = ("ddp", "zero")
    b9_grow_reps: int = 0
    b9_grow_slow_steps: int = 0  # rank 0 3x slower for this many steps after the loss, so that the refill is built in time (a tiny model)
    # B5 (bench/b5.py): a recovery's work for the coordinator and a survivor, simulated ranks at
    # these world sizes (b7_wpn per node), each control, b5_sim_reps runs each, alternated
    b5_ranks: Tuple[int, ...] = (64, 256, 1024, 4096)
    b5_controls: Tuple[str, ...] = ("node", "rank")
    b5_steady_s: float = 3.0
    b5_sim_reps: int = 2
    fsdp_warmup_reps: int = 5  # fresh processes of each kind (bench/fsdp_warmup.py; --only fsdp_warmup)
    copy_cost_sizes: Tuple[str, ...] = ("10M", "100M")  # a shard copy's CPU vs its floor, fresh vs reused landing (bench/copy_cost.py)
    copy_cost_reps: int = 7
    notes: Dict[str, str] = field(default_factory=dict)


QUICK = Plan(
    name="quick",
    b1=[B1Point("tiny", steps=30, fault_step=15, ckpt_every=4)],
    b2_size="tiny", b2_steps=30, b2_fault_step=15, b2_reps=1, b2_required=False,
    b3_size="tiny", b3_steps=150, b3_reps=1, b3_torchft=False,
    b4_bytes=32 << 20, b4_reps=1,
    b5_size="tiny", b5_nodes=(2, 4), b5_steps=30, b5_fault_step=15, b5_reps=1,  # 8 workers: full run only
    # B6: a kill every 2 s of steps (about 270 tiny steps, the kill halfway): the restart baseline still saves
    # checkpoints before its kill and resumes from one; each second costs both runs of B6 (two restarts' worth)
    b6_size="tiny", b6_interval_s=2.0, b6_failures=1,
    b7_ranks=(300,), b7_steady_s=1.0,  # B5's window: the sim point of 300 ranks with relays is then B5's largest too, run once
    fsdp_warmup_reps=1,
    copy_cost_sizes=("1M",), copy_cost_reps=2,
    b5_ranks=(32, 300), b5_controls=("node",), b5_steady_s=1.0, b5_sim_reps=1,
)

FULL = Plan(
    name="full",
    b1=[
        B1Point("10M", steps=14, fault_step=7, ckpt_every=4, reps=3),  # medians of 3, with min and max
        B1Point("100M", steps=8, fault_step=4, ckpt_every=4, reps=3),
    ],
    b2_size="default", b2_steps=40, b2_fault_step=20, b2_reps=2, b2_required=True,
    b3_size="default", b3_steps=300, b3_reps=5, b3_torchft=True,
    b4_bytes=1_200_000_000, b4_reps=3,  # the AdamW state of the 100 M model
    b5_size="default", b5_nodes=(2, 4, 8), b5_steps=40, b5_fault_step=20, b5_reps=2,
    b6_size="default", b6_interval_s=60.0, b6_failures=2,
    b8_size="100M", b8_steps=16, b8_reps=2, b8_factors=(1, 2), b8_recover_sizes=("10M", "100M"), b8_recover_steps=10,
    b8_modes=("zero", "fsdp"), b8_modes_available=("zero", "fsdp", "hsdp"),
    b1_slurm_reps=3,
    # 2 -> 1 first: on 2 cores, 3 processes before the loss already share the cores, which makes
    # the wall-time slowdown of 3 -> 2 look better than ideal; 3 -> 2 is kept as the second point
    b9_size="10M", b9_steps=14, b9_reps=3, b9_shrinks=((2, 1), (3, 2)), b9_shrink_steps=24, b9_fault_step=10, b9_shrink_reps=2,
    b9_grow_reps=2,
)

PLANS = {"quick": QUICK, "full": FULL}
