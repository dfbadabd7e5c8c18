"""Goodput at scale: checkpointless recovery vs checkpoint-restart at its optimal interval.

A pure model (no processes, no torch): failures arrive as a Poisson process whose rate grows
with the GPU count; each system pays its own cost per failure.

- **Checkpointless** (this project): a failure costs the measured recovery downtime ``D``
  (detect + reconfigure + transfer + the first step after it); no work is lost beyond the
  in-flight step, which ``D`` already contains. A failure during a recovery starts it again,
  so ``goodput = exp(-D / M)`` for a mean time between failures ``M``.
- **Checkpoint-restart**: a blocking checkpoint of cost ``C`` every ``tau`` seconds of work;
  a failure loses the work since the last checkpoint and costs a restart ``R`` (stop every
  process, relaunch, load the checkpoint). Daly's model (J. T. Daly, "A higher order estimate
  of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006):
  ``T_wall / T_work = M * exp(R / M) * (exp((tau + C) / M) - 1) / tau``, evaluated at the
  ``tau`` that maximises goodput (found numerically; Young's ``sqrt(2 C M)`` and Daly's
  higher-order estimate are reported next to it).

Goodput is the project's definition (summary.json): the fraction of wall time spent in
productive steps. A checkpointless step may also be slower than a plain DDP step
(``steady_overhead``, benchmark B3): ``throughput = goodput * (1 - steady_overhead)`` is the
useful work per wall second relative to failure-free plain DDP, the number to put next to
checkpoint-restart's goodput (whose steady state *is* plain DDP; its checkpoint writes are
already in its goodput).

Both closed forms are checked against a seeded event-driven Monte Carlo run of each policy
(``simulate_*``). Failure rate default: Llama 3 pre-training, 419 unexpected interruptions in
54 days on 16,384 GPUs (Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, 2024, §3.3.4).
Group (re-)formation cost grows with the world size: ``group_init_per_doubling_s`` is added to
both the checkpointless reconfigure phase and the restart, per doubling of the GPU count
beyond ``ref_gpus`` (the size at which the phases were measured).

The transfer phase is either the measured ``transfer_s`` or, given ``state_gb`` and
``source_gb_per_s``, derived from bandwidth: a replacement fetching disjoint pieces from
``sources`` peers at once receives at ``min(sources * source_gb_per_s, link_gb_per_s)`` (on a
cluster each node has its own link, so senders add up until the receiver's link is full; on one
machine's loopback they share the same cores and add little). Only ``params_fraction`` of the
bytes (parameters, buffers, scalars) must arrive before the first step; the rest (optimizer
moments) may arrive during the first step's forward and backward, ``overlap_s`` of compute that
hides that much of it.

``python -m ckptless_hpc.tools.sim --gpus 16384`` prints the comparison; ``--help`` lists the costs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

# Llama 3 (arXiv:2407.21783, section 3.3.4): 466 interruptions in a 54-day snapshot of
# pre-training on 16,384 H100 GPUs, 419 of them unexpected (78% hardware: GPU, HBM, host...).
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
SECONDS_PER_HOUR = 3600.0


def llama3_failures_per_gpu_hour() -> float:
    """419 / (54 days * 24 h * 16,384 GPUs) = 1.97e-5 failures per GPU-hour."""
    return LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)


@dataclass(frozen=True)
class Costs:
    """Per-failure and steady-state costs, in seconds (fractions for overheads).

    Defaults: the 100 M-parameter model (1.19 GB of state) measured by ``python -m bench`` on
    the project's 2-core CPU machine (docs/benchmarks.md, 2026-11-29); pass your own with the
    CLI flags: at scale, restart and checkpoint costs are far larger than on one machine.
    """

    detect_s: float = 3.00  # checkpointless: failure -> detected (heartbeat timeout: a dead node sends nothing)
    reconfigure_s: float = 0.08  # checkpointless: plan, abort survivors, re-form the group
    transfer_s: float = 0.58  # checkpointless: state of the failed ranks pulled from a peer (1.19 GB)
    resume_s: float = 1.03  # checkpointless: the first step after the recovery (redoes the in-flight step)
    steady_overhead: float = 0.0  # checkpointless: step-time overhead vs plain DDP (fraction; B3 measured +0.1%)
    save_s: float = 3.23  # checkpoint-restart: blocking checkpoint write (C), torch.save + fsync of 1.19 GB
    restart_s: float = 5.28  # checkpoint-restart: failure -> every rank relaunched, group formed, checkpoint loaded (R)
    group_init_per_doubling_s: float = 0.007  # added to reconfigure and restart per doubling beyond ref_gpus (B5)
    ref_gpus: int = 2  # world size at which the phases above were measured
    state_gb: float = 0.0  # checkpointless: bytes a replacement fetches (GB); 0: use transfer_s as measured
    source_gb_per_s: float = 0.0  # one source's sending rate (GB/s; B4 measured 2.38 on loopback)
    sources: int = 1  # peers a replacement fetches disjoint pieces from at once
    link_gb_per_s: float = 0.0  # the receiver's link: the most the sources add up to (GB/s); 0: no cap
    params_fraction: float = 1.0  # share of the state the first step needs before it starts (1: all of it)
    overlap_s: float = 0.0  # first-step compute (forward + backward) that the rest of the state arrives behind

    def validate(self) -> None:
        for name in (
            "detect_s",
            "reconfigure_s",
            "transfer_s",
            "resume_s",
            "save_s",
            "restart_s",
            "group_init_per_doubling_s",
            "state_gb",
            "source_gb_per_s",
            "link_gb_per_s",
            "overlap_s",
        ):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name}={v!r}: must be a finite number >= 0. HINT: costs are seconds measured by python -m bench")
        if not 0 <= self.steady_overhead < 1:
            raise ValueError(f"steady_overhead={self.steady_overhead!r}: must be in [0, 1). HINT: 0.02 means steps 2% slower than plain DDP")
        if self.save_s <= 0:
            raise ValueError(f"save_s={self.save_s!r}: a checkpoint cannot be free. HINT: pass the measured torch.save time")
        if self.ref_gpus < 1:
            raise ValueError(f"ref_gpus={self.ref_gpus!r}: must be >= 1. HINT: the world size the costs were measured at")
        if self.sources < 1:
            raise ValueError(f"sources={self.sources!r}: must be >= 1. HINT: the peers a replacement fetches from at once")
        if not 0 < self.params_fraction <= 1:
            raise ValueError(f"params_fraction={self.params_fraction!r}: must be in (0, 1]. HINT: AdamW state is 2/3 of the bytes, so parameters first is about 0.33")
        if self.state_gb > 0 and self.source_gb_per_s <= 0:
            raise ValueError(f"state_gb={self.state_gb!r} needs source_gb_per_s > 0 (seen {self.source_gb_per_s!r}). HINT: B4's state transfer rate, e.g. 2.38")

    def fetch_s(self) -> float:
        """The whole state's transfer: measured, or bytes over the bandwidth of ``sources`` peers."""
        if self.state_gb <= 0:
            return self.transfer_s
        rate = self.sources * self.source_gb_per_s
        if self.link_gb_per_s > 0:
            rate = min(rate, self.link_gb_per_s)
        return self.state_gb / rate

    def critical_transfer_s(self) -> float:
        """The part of the transfer the recovery waits for: what the first step needs before it
        starts, plus whatever of the rest its forward and backward (``overlap_s``) do not hide."""
        t = self.fetch_s()
        first = self.params_fraction * t
        return first + max(0.0, t - first - self.overlap_s)

    def scale_s(self, gpus: int) -> float:
        """Extra group-formation time at ``gpus`` GPUs, relative to ``ref_gpus``."""
        return self.group_init_per_doubling_s * max(0.0, math.log2(gpus / self.ref_gpus))

    def downtime_s(self, gpus: int) -> float:
        """Checkpointless downtime per failure at ``gpus`` GPUs."""
        return self.detect_s + self.reconfigure_s + self.scale_s(gpus) + self.critical_transfer_s() + self.resume_s

    def restart_at_s(self, gpus: int) -> float:
        return self.restart_s + self.scale_s(gpus)


def mtbf_s(gpus: int, failures_per_gpu_hour: float) -> float:
    """Mean time between failures of a job on ``gpus`` GPUs, in seconds."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus!r}: must be >= 1. HINT: e.g. --gpus 16384")
    if not failures_per_gpu_hour > 0:
        raise ValueError(f"failures_per_gpu_hour={failures_per_gpu_hour!r}: must be > 0. HINT: Llama 3 saw {llama3_failures_per_gpu_hour():.3g}")
    return SECONDS_PER_HOUR / (gpus * failures_per_gpu_hour)


# ------------------------------------------------------------------------------ checkpointless


def checkpointless_goodput(downtime_s: float, mtbf: float) -> float:
    """Fraction of wall time spent in productive steps; a failure during a recovery restarts it."""
    return math.exp(-downtime_s / mtbf)


# ------------------------------------------------------------------------------ checkpoint-restart


def young_interval_s(save_s: float, mtbf: float) -> float:
    """Young (CACM 17(9), 1974): the first-order optimum checkpoint interval sqrt(2 C M)."""
    return math.sqrt(2.0 * save_s * mtbf)


def daly_interval_s(save_s: float, mtbf: float) -> float:
    """Daly (2006): the higher-order estimate of the optimum interval (M when C >= 2M)."""
    if save_s >= 2.0 * mtbf:
        return mtbf
    x = save_s / (2.0 * mtbf)
    return math.sqrt(2.0 * save_s * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def ckpt_restart_goodput(interval_s: float, save_s: float, restart_s: float, mtbf: float) -> float:
    """Daly (2006): work time over expected wall time for checkpoint interval ``interval_s``."""
    if interval_s <= 0:
        raise ValueError(f"interval_s={interval_s!r}: must be > 0")
    wall_per_work = mtbf * math.exp(restart_s / mtbf) * math.expm1((interval_s + save_s) / mtbf) / interval_s
    return 1.0 / wall_per_work


def optimal_interval_s(save_s: float, restart_s: float, mtbf: float) -> float:
    """The interval that maximises ``ckpt_restart_goodput`` (golden-section search; unimodal)."""
    lo, hi = 1e-6 * mtbf, 20.0 * mtbf
    f = lambda t: -ckpt_restart_goodput(t, save_s, restart_s, mtbf)  # noqa: E731
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = math.log(lo), math.log(hi)  # search in log space: the optimum spans many decades
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(200):
        if f(math.exp(c)) < f(math.exp(d)):
            b = d
        else:
            a = c
        c, d = b - g * (b - a), a + g * (b - a)
    return math.exp((a + b) / 2.0)


# ------------------------------------------------------------------------------ Monte Carlo


def simulate_checkpointless(downtime_s: float, mtbf: float, work_s: float, seed: int = 0, steady_overhead: float = 0.0) -> float:
    """Event-driven run of ``work_s`` seconds of work; returns work over wall time (the goodput,
    times ``1 - steady_overhead`` when steps run that much slower than plain DDP)."""
    rng = random.Random(seed)
    rate_work = 1.0 - steady_overhead
    done = wall = 0.0
    while done < work_s:
        x = rng.expovariate(1.0 / mtbf)
        need = (work_s - done) / rate_work
        if x >= need:
            wall += need
            break
        wall += x
        done += x * rate_work
        while True:  # recover; a failure during the recovery starts it again
            y = rng.expovariate(1.0 / mtbf)
            if y >= downtime_s:
                wall += downtime_s
                break
            wall += y
    return work_s / wall


def simulate_ckpt_restart(interval_s: float, save_s: float, restart_s: float, mtbf: float, work_s: float, seed: int = 0) -> float:
    """Event-driven run with a checkpoint every ``interval_s`` of work; returns the goodput."""
    rng = random.Random(seed)
    done = wall = 0.0
    while done < work_s:
        seg = min(interval_s, work_s - done)
        cost = seg + save_s
        x = rng.expovariate(1.0 / mtbf)
        if x >= cost:
            wall += cost
            done += seg
            continue
        wall += x  # the segment's work is lost
        while True:  # restart from the last checkpoint; a failure during it starts it again
            y = rng.expovariate(1.0 / mtbf)
            if y >= restart_s:
                wall += restart_s
                break
            wall += y
    return work_s / wall


# ------------------------------------------------------------------------------ comparison


@dataclass(frozen=True)
class Point:
    gpus: int
    mtbf_s: float
    failures_per_day: float
    checkpointless_downtime_s: float
    checkpointless_goodput: float
    checkpointless_throughput: float  # goodput * (1 - steady_overhead): useful work vs failure-free plain DDP
    restart_s: float
    interval_s: float  # optimal checkpoint interval (numeric)
    young_interval_s: float
    daly_interval_s: float
    ckpt_restart_goodput: float

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


def compare(gpus: int, costs: Costs, failures_per_gpu_hour: Optional[float] = None) -> Point:
    """Both systems at ``gpus`` GPUs, checkpoint-restart at its optimal interval."""
    costs.validate()
    rate = llama3_failures_per_gpu_hour() if failures_per_gpu_hour is None else failures_per_gpu_hour
    m = mtbf_s(gpus, rate)
    d = costs.downtime_s(gpus)
    r = costs.restart_at_s(gpus)
    tau = optimal_interval_s(costs.save_s, r, m)
    return Point(
        gpus=gpus,
        mtbf_s=m,
        failures_per_day=86400.0 / m,
        checkpointless_downtime_s=d,
        checkpointless_goodput=checkpointless_goodput(d, m),
        checkpointless_throughput=checkpointless_goodput(d, m) * (1.0 - costs.steady_overhead),
        restart_s=r,
        interval_s=tau,
        young_interval_s=young_interval_s(costs.save_s, m),
        daly_interval_s=daly_interval_s(costs.save_s, m),
        ckpt_restart_goodput=ckpt_restart_goodput(tau, costs.save_s, r, m),
    )


DEFAULT_GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)


def sweep(costs: Costs, gpus: Sequence[int] = DEFAULT_GPUS, failures_per_gpu_hour: Optional[float] = None) -> List[Point]:
    return [compare(g, costs, failures_per_gpu_hour) for g in gpus]


def format_table(points: Sequence[Point]) -> str:
    head = f"{'GPUs':>7} {'MTBF':>8} {'fail/day':>8} | {'ckptless D':>10} {'goodput':>8} {'x(1-ovh)':>8} | {'restart R':>9} {'interval':>9} {'Young':>8} {'goodput':>8}"
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(
            f"{p.gpus:>7} {p.mtbf_s / 60:>7.1f}m {p.failures_per_day:>8.1f} | {p.checkpointless_downtime_s:>9.2f}s {100 * p.checkpointless_goodput:>7.2f}% "
            f"{100 * p.checkpointless_throughput:>7.2f}% | "
            f"{p.restart_s:>8.1f}s {p.interval_s:>8.0f}s {p.young_interval_s:>7.0f}s {100 * p.ckpt_restart_goodput:>7.2f}%"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    d = Costs()
    p = argparse.ArgumentParser(
        prog="python -m ckptless_hpc.tools.sim",
        description="Goodput of checkpointless recovery vs checkpoint-restart (optimal Young/Daly interval) at scale.",
    )
    p.add_argument("--gpus", type=int, action="append", help=f"GPU count (repeatable; default {', '.join(map(str, DEFAULT_GPUS))})")
    p.add_argument("--failures-per-gpu-hour", type=float, default=None, help=f"default: Llama 3, 419 in 54 days on 16,384 GPUs = {llama3_failures_per_gpu_hour():.3g}")
    for f in Costs.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name), help=f"default {getattr(d, f.name)}")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    costs = Costs(**{f: getattr(args, f) for f in Costs.__dataclass_fields__})
    try:
        points = sweep(costs, args.gpus or DEFAULT_GPUS, args.failures_per_gpu_hour)
    except ValueError as e:
        print(f"ckptless_hpc.tools.sim: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"costs": asdict(costs), "points": [p.as_dict() for p in points]}, indent=2))
    else:
        rate = args.failures_per_gpu_hour or llama3_failures_per_gpu_hour()
        print(f"failure rate {rate:.3g} per GPU-hour; costs {asdict(costs)}")
        print(format_table(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "Costs",
    "Point",
    "compare",
    "sweep",
    "mtbf_s",
    "llama3_failures_per_gpu_hour",
    "checkpointless_goodput",
    "young_interval_s",
    "daly_interval_s",
    "ckpt_restart_goodput",
    "optimal_interval_s",
    "simulate_checkpointless",
    "simulate_ckpt_restart",
    "format_table",
]
