"""B4: peer state transfer (ckptless_hpc.state.transfer) vs raw loopback TCP, same bytes.

A source process holds a state of N bytes (float32 tensors of 64 MB, like a big model's
parameters and AdamW moments) and serves it two ways: through ckptless_hpc's StateServer
(authenticated, header + raw tensor bytes + checksum trailer) and as raw bytes over a plain TCP
socket (``sendall`` of the same buffers). The harness, in another process, times
``fetch_state`` as a hot spare calls it (into a pre-touched landing Arena when the core has
one; it also checks the checksum and the step) against a plain ``recv_into`` into a
preallocated buffer: the ceiling of loopback TCP on this machine. It also times the costs a
fetch can add on top of the wire (the checksum, CRC32 for comparison, and the first touch of
freshly allocated memory) to say what bounds the ratio.

``python -m bench.transfer serve BYTES`` is the source process (prints two ports).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from typing import Any, Dict, Iterator, List, Sequence, Tuple

CHUNK_ELEMS = 16 << 20  # 64 MB of float32 per tensor


def _state(nbytes: int):
    import torch

    n = max(1, nbytes // 4)
    entries, i = [], 0
    while n > 0:
        k = min(n, CHUNK_ELEMS)
        entries.append((f"t{i}", torch.full((k,), float(i + 1), dtype=torch.float32)))
        n -= k
        i += 1
    return entries


def serve(nbytes: int) -> None:
    """The source process: a StateServer and a raw TCP sender over the same tensors."""
    from ckptless_hpc.control import wire
    from ckptless_hpc.state.snapshot import byte_view
    from ckptless_hpc.state.transfer import StateServer

    entries = _state(nbytes)
    secret = wire.load_secret()
    server = StateServer("127.0.0.1", secret, lambda gen, step, shard=None, **_: (entries, {"step": step, "param_groups": []}))
    raw = socket.create_server(("127.0.0.1", 0))

    def raw_loop() -> None:
        while True:
            conn, _ = raw.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _, t in entries:
                conn.sendall(byte_view(t))
            conn.close()

    threading.Thread(target=raw_loop, daemon=True).start()
    print(server.port, raw.getsockname()[1], flush=True)
    sys.stdin.read()  # until the harness closes our stdin


def _raw_fetch(port: int, buf: memoryview) -> float:
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port))
    got = 0
    while got < len(buf):
        k = s.recv_into(buf[got:])
        if k == 0:
            raise ConnectionError(f"raw sender closed after {got} of {len(buf)} bytes")
        got += k
    s.close()
    return time.monotonic() - t0


@contextlib.contextmanager
def _source(nbytes: int, secret: str) -> Iterator[Tuple[int, int, int]]:
    """The source process (``serve``) of ``nbytes``: yields its (state port, raw TCP port, pid)."""
    from ckptless_hpc.control import wire

    from .common import REPO

    env = dict(os.environ, **{wire.SECRET_ENV: secret}, OMP_NUM_THREADS="1")
    src = subprocess.Popen([sys.executable, "-m", "bench.transfer", "serve", str(nbytes)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        line = src.stdout.readline().decode().split()
        if len(line) != 2:
            raise RuntimeError("the transfer source process did not start")
        yield int(line[0]), int(line[1]), src.pid
    finally:
        src.stdin.close()
        src.wait(timeout=30)


def floor(nbytes: int, reps: int) -> Dict[str, Any]:
    """The physical floor of a copy of ``nbytes`` (B8): a memcpy into a preallocated buffer and a
    raw loopback TCP transfer (connect included, as a copy's push makes one) into another, in
    seconds: the best of ``reps`` (a floor; other users' load only adds to it), a small memcpy
    repeated to ~64 MB per timing."""
    import torch

    from ckptless_hpc.control import wire

    nbytes = max(4, (nbytes // 4) * 4)
    src_t, dst_t = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    dst_t.copy_(src_t)  # touches the pages
    loops = max(1, (64 << 20) // nbytes)
    copy_s = []
    for _ in range(reps):
        t0 = time.monotonic()
        for _ in range(loops):
            dst_t.copy_(src_t)
        copy_s.append((time.monotonic() - t0) / loops)
    buf = memoryview(bytearray(nbytes))
    from .b7 import cpu_fine_s  # a process's threads' CPU from the scheduler's count

    wire_s, wire_cpu = [], []
    with _source(nbytes, wire.new_secret()) as (_, raw_port, pid):
        _raw_fetch(raw_port, buf)
        for _ in range(reps):
            c0, s0 = time.thread_time(), cpu_fine_s(pid)
            wire_s.append(_raw_fetch(raw_port, buf))
            wire_cpu.append(time.thread_time() - c0 + cpu_fine_s(pid) - s0)
    # loopback_cpu_s: the CPU of both ends of that transfer (the receiving thread's, the sending
    # process's), against which a copy's own threads at both ends compare CPU with CPU
    return {"bytes": nbytes, "memcpy_s": min(copy_s), "loopback_s": min(wire_s), "loopback_cpu_s": min(wire_cpu), "reps": reps}



def measure(nbytes: int, reps: int) -> Dict[str, Any]:
    """Throughputs in GB/s (1e9 bytes), medians of ``reps`` alternating runs."""
    import torch

    from ckptless_hpc.control import wire
    from ckptless_hpc.state import transfer as tr

    from .common import median

    def fetch() -> Any:
        # a hot spare receives into memory it touched while waiting (its Arena), when the core has one
        arena = tr.Arena(nbytes + (1 << 20)) if hasattr(tr, "Arena") else None
        kw = {"arena": arena} if arena is not None else {}
        return tr.fetch_state("127.0.0.1", state_port, secret, 0, 1, 120, **kw)

    secret = wire.new_secret()
    with _source(nbytes, secret) as (state_port, raw_port, _):
        nbytes = (nbytes // 4) * 4
        buf = memoryview(bytearray(nbytes))  # preallocated and touched once: the wire alone
        _raw_fetch(raw_port, buf)  # warm-up of both paths
        fetch()
        raw_s: List[float] = []
        state_s: List[float] = []
        for _ in range(reps):
            raw_s.append(_raw_fetch(raw_port, buf))
            got = fetch()
            if got.nbytes != nbytes:
                raise RuntimeError(f"fetched {got.nbytes} bytes, expected {nbytes}")
            state_s.append(got.seconds)
            del got
        # what a fetch adds to the wire: a checksum pass over the bytes (the core's, and CRC32 for
        # comparison) and the first touch of new memory
        t0 = time.monotonic()
        zlib.crc32(buf)
        crc_s = time.monotonic() - t0
        checksum, checksum_s = "crc32", crc_s
        try:
            import xxhash

            t0 = time.monotonic()
            xxhash.xxh3_64(buf).hexdigest()
            checksum, checksum_s = "xxh3_64", time.monotonic() - t0
        except ImportError:
            pass
        t0 = time.monotonic()
        fresh = torch.empty(nbytes // 4, dtype=torch.float32)
        fresh.view(torch.uint8)[:: 4096] = 0  # one write per page: the page-fault cost
        touch_s = time.monotonic() - t0
        del fresh
    raw_gbps = nbytes / median(raw_s) / 1e9
    state_gbps = nbytes / median(state_s) / 1e9
    return {
        "bytes": nbytes,
        "reps": reps,
        "raw_tcp_gbps": raw_gbps,
        "state_transfer_gbps": state_gbps,
        "fraction_of_loopback": state_gbps / raw_gbps,
        "raw_s": raw_s,
        "state_s": state_s,
        "crc32_gbps": nbytes / crc_s / 1e9,
        "checksum": checksum,
        "checksum_gbps": nbytes / checksum_s / 1e9,
        "arena": hasattr(tr, "Arena"),
        "first_touch_gbps": nbytes / touch_s / 1e9,
    }


def measure_sources(nbytes: int, reps: int, counts: Sequence[int] = (1, 2, 4)) -> Dict[str, Any]:
    """Several sources at once (ckptless_hpc.state.fetch): the same state held by ``max(counts)``
    source processes, fetched in disjoint groups from ``k`` of them at once, ``k`` in ``counts``,
    alternated ``reps`` times. On one machine every source shares the same cores and loopback: the
    figure says what the parallel path costs or gives here, not what separate links would give."""
    from ckptless_hpc.control import wire
    from ckptless_hpc.state import fetch as fe
    from ckptless_hpc.state import transfer as tr

    from .common import REPO, median

    secret = wire.new_secret()
    env = dict(os.environ, **{wire.SECRET_ENV: secret}, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "bench.transfer", "serve", str(nbytes)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) for _ in range(max(counts))]
    try:
        sources = []
        for i, src in enumerate(procs):
            line = src.stdout.readline().decode().split()
            if len(line) != 2:
                raise RuntimeError("a transfer source process did not start")
            sources.append(fe.Source(f"source{i}", "127.0.0.1", int(line[0])))
        nbytes = (nbytes // 4) * 4
        arena = tr.Arena(nbytes + (1 << 20))  # touched once: a hot spare's landing memory

        def one(k: int) -> float:
            arena.offset = 0
            got = fe.fetch(sources[:k], secret, tr.Want(0, 1), 120, arena, parallel=k)
            if got.received.nbytes != nbytes or len(got.by_source) != k:  # one group per source (a group may be empty)
                raise RuntimeError(f"{k} sources: fetched {got.received.nbytes} bytes from {sorted(got.by_source)}, expected {nbytes} from {k}")
            return got.received.seconds

        for k in counts:
            one(k)  # warm-up
        seconds: Dict[int, List[float]] = {k: [] for k in counts}
        for _ in range(reps):
            for k in counts:
                seconds[k].append(one(k))
    finally:
        for src in procs:
            src.stdin.close()
        for src in procs:
            src.wait(timeout=30)
    gbps = {str(k): nbytes / median(v) / 1e9 for k, v in seconds.items()}
    return {"bytes": nbytes, "reps": reps, "gbps": gbps, "seconds": {str(k): v for k, v in seconds.items()}, "speedup_max_vs_1": gbps[str(max(counts))] / gbps[str(min(counts))]}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m bench.transfer serve BYTES  (started by the harness)")
