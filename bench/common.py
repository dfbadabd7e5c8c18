"""Shared pieces of the benchmark harness: model sizes, running a ckptless_hpc job, statistics.

Nothing here is timed: it starts processes and reads what they left behind (summary.json,
events.jsonl, per-rank JSONL files). Timing comes from those files, stamped where the event
happened.
"""

from __future__ import annotations

import math

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]

# LM sizes (ckptless_hpc.tasks.lm.LMTask arguments). Parameter counts are exact.
SIZES: Dict[str, Dict[str, int]] = {
    # the CI smoke: 68 K parameters, a few ms per step
    "tiny": dict(d_model=64, n_layers=1, n_heads=2, seq_len=32, batch_size=4),
    # the task's default: 437,760 parameters, ~20-50 ms per step here
    "default": dict(d_model=128, n_layers=2, n_heads=4, seq_len=64, batch_size=8),
    # ~10.8 M parameters, ~1.3 s per step on one thread here
    "10M": dict(d_model=384, n_layers=6, n_heads=6, seq_len=256, batch_size=8),
    # ~99.6 M parameters (state with AdamW: 1.2 GB); a short sequence and batch of one keep
    # the step near 1 s on this CPU: what matters for recovery is the size of the state
    "100M": dict(d_model=768, n_layers=14, n_heads=12, seq_len=32, batch_size=1),
}


class BenchError(RuntimeError):
    """A benchmark run did not do what it had to (non-zero exit, missing output)."""


def task_overrides(size: str) -> List[str]:
    return ["task=lm"] + [f"task.{k}={v}" for k, v in SIZES[size].items()]


def lm_params(size: str) -> int:
    """Exact parameter count of an LM size, without building it."""
    from ckptless_hpc.tasks.lm import LMTask

    return LMTask(**SIZES[size]).num_parameters()


def median(xs: Iterable[float]) -> float:
    xs = [float(x) for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def verdict(overheads_pct: Sequence[float], target_pct: float) -> str:
    """A target's verdict from back-to-back pairs (each an overhead in %): "yes" when every pair
    is within the target, "NO" when every pair is past it, and "unresolved at this load" when the
    pairs fall on both sides (the spread allows no verdict)."""
    xs = [x for x in overheads_pct if x is not None and x == x]
    if not xs:
        return "n/a"
    if max(xs) <= target_pct:
        return "yes"
    if min(xs) > target_pct:
        return "NO"
    return "unresolved at this load"


def median_interval(xs: Iterable[float], level: float = 0.9) -> Dict[str, Any]:
    """A distribution-free interval for the median of repetitions (order statistics: the k-th
    smallest and the k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2),
    so that pairs spread by load can still give a verdict once there are enough of them;
    ``coverage``: the interval's exact confidence (>= ``level``), None when n is too small."""
    v = sorted(float(x) for x in xs if x is not None and x == x)
    n = len(v)
    k, tail = 0, 0.0
    while k < n // 2:
        below = tail + math.comb(n, k) / 2.0**n  # P(B <= k): the interval [v[k], v[n-1-k]] misses with twice that
        if below > (1.0 - level) / 2.0:
            break
        k, tail = k + 1, below
    if k == 0:
        return {"n": n, "low": None, "high": None, "coverage": None}
    return {"n": n, "low": v[k - 1], "high": v[n - k], "coverage": 1.0 - 2.0 * tail}


def median_verdict(overheads_pct: Sequence[float], target_pct: float, level: float = 0.9) -> str:
    """The verdict on the median overhead of many pairs: "yes" when the interval of
    :func:`median_interval` lies within the target, "NO" when it lies past it, else "unresolved"
    ("too few pairs" when n gives no interval at this level: 5 or more are needed at 0.9)."""
    ci = median_interval(overheads_pct, level)
    if ci["coverage"] is None:
        return "too few pairs"
    if ci["high"] <= target_pct:
        return "yes"
    if ci["low"] > target_pct:
        return "NO"
    return "unresolved"


def spread(xs: Iterable[float]) -> Dict[str, float]:
    """Median, min and max of repetitions (for a table's "median (min-max)")."""
    v = [float(x) for x in xs if x is not None]
    return {"median": median(v), "min": min(v) if v else float("nan"), "max": max(v) if v else float("nan"), "n": len(v)}


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a SIGKILL
    return out


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_table() -> Dict[int, tuple]:
    """pid -> (ppid, cpu seconds (user + system), command line) of every process we can read."""
    out: Dict[int, tuple] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK, cmd)
    return out


class CpuSampler:
    """Samples the CPU time of a process tree every ``period_s`` (Linux /proc), in a thread.

    Wall-clock step times on a shared 2-core machine drift with other people's load; the CPU
    seconds a system spends per step drift much less, and say where its extra work goes.
    """

    def __init__(self, root_pid: int, period_s: float = 0.25) -> None:
        self.root, self.period_s = root_pid, period_s
        self.samples: List[tuple] = []  # (time.time(), {pid: (cpu_s, cmdline)})
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "CpuSampler":
        self._t.start()
        return self

    def stop(self) -> List[tuple]:
        self._stop.set()
        self._t.join()
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            table = _proc_table()
            tree, frontier = {self.root}, [self.root]
            children: Dict[int, List[int]] = {}
            for pid, (ppid, _, _) in table.items():
                children.setdefault(ppid, []).append(pid)
            while frontier:
                nxt = [c for p in frontier for c in children.get(p, [])]
                tree.update(nxt)
                frontier = nxt
            self.samples.append((time.time(), {p: (table[p][1], table[p][2]) for p in tree if p in table}))
            self._stop.wait(self.period_s)


def cpu_per_step(samples: List[tuple], step_times: List[float], match: Callable[[str], bool], skip_steps: int = 10) -> float:
    """CPU seconds per committed step of the sampled processes whose command line satisfies
    ``match``, over the steady window (after ``skip_steps`` steps, before the last step)."""
    if len(step_times) <= skip_steps + 2:
        return float("nan")
    got = cpu_within(samples, step_times[skip_steps], step_times[-1], match)
    if got is None:
        return float("nan")
    cpu, t1, t2, pids = got
    steps = sum(1 for t in step_times if t1 < t <= t2)
    if not pids or steps == 0:
        return float("nan")
    return cpu / steps


def cpu_within(samples: List[tuple], lo: float, hi: float, match: Callable[[str], bool]) -> Optional[Tuple[float, float, float, int]]:
    """(CPU seconds, first sample's time, last sample's time, processes) of the sampled processes whose
    command line satisfies ``match``, between the first and the last sample within [lo, hi]; None with fewer than 2."""
    window = [s for s in samples if lo <= s[0] <= hi]
    if len(window) < 2:
        return None
    (t1, a), (t2, b) = window[0], window[-1]
    pids = [p for p in b if p in a and match(b[p][1])]
    return sum(b[p][0] - a[p][0] for p in pids), t1, t2, len(pids)


@dataclass
class JobRun:
    """A finished ckptless_hpc job: its summary and event log."""

    run_dir: Path
    summary: Dict[str, Any]
    events: List[Dict[str, Any]]
    elapsed_s: float
    cpu_samples: Optional[List[tuple]] = None

    def of(self, kind: str) -> List[Dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def step_intervals(self, skip: int = 5) -> List[float]:
        """Wall time between consecutive committed steps of one generation (warm-up skipped)."""
        steps = [e for e in self.of("step") if e.get("step") is not None]
        out = []
        for a, b in zip(steps, steps[1:]):
            if b["step"] == a["step"] + 1 and a.get("gen") == b.get("gen") and a["step"] > skip:
                out.append(b["time"] - a["time"])
        return out

    def step_times(self, skip: int = 5) -> List[float]:
        """Step times measured inside rank 0 (batch .. optimizer step), warm-up skipped."""
        return [e["step_s"] for e in self.of("step") if e.get("step", 0) > skip and e.get("step_s") is not None]


def run_ckptless(run_dir: Path, overrides: Sequence[str], timeout_s: float = 600, expect_rc: int = 0, sample_cpu: bool = False, env: Optional[Dict[str, str]] = None) -> JobRun:
    """Run ``python -m ckptless_hpc`` as a user would; its output goes to run_dir/stdout.log.
    ``env``: laid over this process's environment for the job (the coordinator and its workers)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ckptless_hpc", f"hydra.run.dir={run_dir}", "train.log_every=1000000", *overrides]
    t0 = time.monotonic()
    with open(run_dir / "stdout.log", "w", encoding="utf-8") as out:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=None if env is None else {**os.environ, **env})
        sampler = CpuSampler(p.pid).start() if sample_cpu else None
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise BenchError(f"ckptless_hpc job in {run_dir} ran past {timeout_s:.0f}s; see {run_dir}/stdout.log") from None
        finally:
            samples = sampler.stop() if sampler else None
    elapsed = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    if rc != expect_rc or not summary_path.exists():
        tail = (run_dir / "stdout.log").read_text(encoding="utf-8", errors="replace")[-3000:]
        raise BenchError(f"ckptless_hpc job exited {rc} (expected {expect_rc}): {' '.join(cmd)}\n{tail}")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    events = read_jsonl(run_dir / "events.jsonl")
    prune_weights(run_dir)
    return JobRun(run_dir, summary, events, elapsed, samples)


def prune_weights(run_dir: Path) -> None:
    """Delete a finished job's weights (final/, saved/, state/): no bench reads them back (the summary
    holds their sha256), and a full run's 100 jobs of up to 1.5 GB each would fill the disk."""
    for name in ("final", "saved", "state"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def torchft_version() -> Optional[str]:
    """The installed torchft distribution's version (torchft-nightly, or torchft); None without it."""
    from importlib import metadata

    for dist in ("torchft-nightly", "torchft"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def machine_info() -> Dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb: Optional[float] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = round(int(line.split()[1]) / 1e6, 1)
    except OSError:
        pass
    commit = os.environ.get("BENCH_CORE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            commit = None
    if not commit:
        print(
            f"bench: the core's commit is unknown ({REPO} is not a git checkout): the results will not name it. HINT: BENCH_CORE_COMMIT=<commit> python -m bench ...",
            file=sys.stderr,
        )
    import ckptless_hpc

    return {
        "core_commit": commit,
        "core_path": str(Path(ckptless_hpc.__file__).parent),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gb": mem_gb,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchft": torchft_version(),  # B2 needs it in a full run (bench/setup.sh)
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def free_port_store():
    """A master TCPStore on a free loopback port, owned by the harness."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def ms_or_na(seconds: Optional[float], digits: int) -> str:
    """Seconds as milliseconds, or n/a where there is no figure (a run too short to sample its CPU)."""
    return "n/a" if seconds is None else f"{1e3 * seconds:.{digits}f}"


def finite(x: Any) -> Optional[float]:
    """A JSON-safe number: NaN and infinities become None (null)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None
