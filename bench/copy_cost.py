"""``python -m bench --only copy_cost``: what one shard copy costs the sender and its holder,
against the copy's physical floor, with a holder landing each copy in fresh memory (before
issue 30) and in the buffers of the copy it dropped (after), side by side in one process.

A copy (``parallel=zero|fsdp``, ``replication.factor >= 1``; docs/sharding.md) is a snapshot
of the rank's shard into reused buffers (``ShardStore.snapshot``), a push over TCP to the
holder's state server with an xxh3 trailer (``transfer.push_state``), and the holder's receive,
check and keep (``ShardStore.keep``). Here a rank's shard is a state of N parameters laid out
as an Adam rank holds it (parameters, two moments: 3 x 4 x N bytes, in tensors of 4 M elements
at most), the holder is a real ``StateServer`` in the same process (so the process's CPU time is
the sender's plus the holder's), and every sample is a whole copy: snapshot, push, ack.

The floor of the same bytes: one memcpy (the snapshot) plus one raw TCP loopback transfer
(sendall / recv_into, no checksum). ``cpu_over_floor`` is the copy's CPU over the floor's CPU.
Samples of the two landings alternate; medians of ``reps`` copies after one warm-up copy each.
"""

from __future__ import annotations

import resource
import socket
import statistics
import threading
import time
from typing import Any, Dict, List

SLICE = 8 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _state(params: int) -> List[Any]:
    import torch

    out, left, i = [], params, 0
    while left > 0:
        n = min(left, 4 << 20)
        for kind in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
            out.append((f"{kind}/t{i}", torch.randn(n)))
        left -= n
        i += 1
    return out


def _floor(entries: List[Any], reps: int) -> Dict[str, float]:
    """One memcpy and one raw TCP loopback transfer of the state's bytes: CPU and wall, medians."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for _, t in entries)
    dst = [torch.empty_like(t) for _, t in entries]
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    sink = bytearray(SLICE)
    cpu, wall = [], []
    for _ in range(reps + 1):

        def rx() -> None:
            mv, left = memoryview(sink), nbytes
            while left > 0:
                left -= b.recv_into(mv[: min(len(mv), left)])

        c0, t0 = _cpu(), time.perf_counter()
        for d, (_, t) in zip(dst, entries):
            d.copy_(t)
        th = threading.Thread(target=rx)
        th.start()
        for _, t in entries:
            mv = memoryview(t.numpy()).cast("B")
            for off in range(0, len(mv), SLICE):
                a.sendall(mv[off : off + SLICE])
        th.join()
        cpu.append(_cpu() - c0)
        wall.append(time.perf_counter() - t0)
    for s in (a, b, server):
        s.close()
    return {"cpu_s": statistics.median(cpu[1:]), "wall_s": statistics.median(wall[1:])}


def _holder(secret: str, store: Any, landing: bool) -> Any:
    """A state server keeping the copies pushed to it in ``store``, landing them in the buffers
    of the copy it dropped (``landing``) or in fresh memory."""
    from ckptless_hpc.state.transfer import StateServer

    return StateServer("127.0.0.1", secret, lambda *a, **k: None, receiver=lambda g, sh, st, got: store.keep(sh, st, got), landing=store.landing if landing else None)


def measure(sizes: Dict[str, int], reps: int) -> Dict[str, Any]:
    """Per size: the floor, and a copy's CPU and wall with each landing (medians of ``reps``).
    One torch thread, as a worker runs (``train.threads=1``): with torch's default the floor's
    memcpy spins OpenMP threads and counts their CPU, which made the floor look dearer."""
    import torch

    from ckptless_hpc.state.shards import ShardStore
    from ckptless_hpc.state.transfer import push_state

    torch.set_num_threads(1)

    secret = "b" * 32
    rows = []
    for label, params in sizes.items():
        entries = _state(params)
        nbytes = sum(t.numel() * t.element_size() for _, t in entries)
        floor = _floor(entries, reps)
        row: Dict[str, Any] = {"size": label, "params": params, "state_mb": nbytes / 1e6, "floor": floor}
        stores = {"fresh": ShardStore(), "landing": ShardStore()}
        servers = {kind: _holder(secret, store, kind == "landing") for kind, store in stores.items()}
        own = ShardStore()
        samples: Dict[str, List[Any]] = {"fresh": [], "landing": []}
        for step in range(1, reps + 2):
            for kind in ("fresh", "landing") if step % 2 else ("landing", "fresh"):
                stores[kind].durable(step - 1)  # as in a job: step s-1 is durable before s's copy is sent
                c0, t0 = _cpu(), time.perf_counter()
                copy = own.snapshot(step, entries, {"step": step})
                push_state("127.0.0.1", servers[kind].port, secret, 0, 0, step, *copy, timeout_s=120)
                own.durable(step)
                if step > 1:  # the first copy of each: warm-up (nothing to land in yet)
                    samples[kind].append((_cpu() - c0, time.perf_counter() - t0))
        for kind, xs in samples.items():
            cpu = statistics.median(c for c, _ in xs)
            row[kind] = {"cpu_s": cpu, "wall_s": statistics.median(w for _, w in xs), "cpu_over_floor": cpu / floor["cpu_s"]}
        row["cpu_saved_pct"] = 100.0 * (1 - row["landing"]["cpu_s"] / row["fresh"]["cpu_s"])
        for s in servers.values():
            s.close()
        rows.append(row)
    return {"reps": reps, "rows": rows}


def table(res: Dict[str, Any]) -> str:
    lines = [f"{'copy cost':<12}{'state':>10}{'floor cpu':>11}{'fresh cpu':>11}{'x floor':>9}{'landing cpu':>13}{'x floor':>9}{'saved':>8}"]
    for r in res["rows"]:
        f, a, b = r["floor"], r["fresh"], r["landing"]
        lines.append(
            f"{r['size']:<12}{r['state_mb']:>8.0f}MB{f['cpu_s']:>10.3f}s{a['cpu_s']:>10.3f}s{a['cpu_over_floor']:>8.2f}x{b['cpu_s']:>12.3f}s{b['cpu_over_floor']:>8.2f}x{r['cpu_saved_pct']:>7.0f}%"
        )
    return "\n".join(lines)


def headline(res: Any) -> Dict[str, Any]:
    rows = {r["size"]: r for r in (res or {}).get("rows", [])}
    out: Dict[str, Any] = {}
    for size, r in rows.items():
        key = size.lower()
        out[f"copy_cpu_over_floor_fresh_{key}"] = r["fresh"]["cpu_over_floor"]
        out[f"copy_cpu_over_floor_landing_{key}"] = r["landing"]["cpu_over_floor"]
    return out


if __name__ == "__main__":
    import json
    import sys

    sizes = {"10M": 10_000_000, "100M": 100_000_000} if "--full" in sys.argv else {"1M": 1_000_000}
    res = measure(sizes, reps=7 if "--full" in sys.argv else 3)
    print(table(res))
    print(json.dumps(headline(res)))
