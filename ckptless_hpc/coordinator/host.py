"""What the coordinator's process asks of its host to serve thousands of connections: a deep
listen queue, enough file descriptors, a garbage collector that does not stall the loop, and
a look at bytes waiting unread in a connection. No decisions here."""

from __future__ import annotations

import gc
import logging

from ..control.server import kernel_unread  # noqa: F401  (the control server's; read here by the tests of the host)

log = logging.getLogger("ckptless_hpc.coordinator")

# every rank connects at once at start-up: the queue is as deep as the kernel allows
# (net.core.somaxconn), and clients whose connection a full queue dropped retry
# (protocol.connect_paced). asyncio also accepts up to this many per wake-up.
SOMAXCONN = "/proc/sys/net/core/somaxconn"


def listen_backlog(path: str = SOMAXCONN) -> int:
    try:
        with open(path, encoding="ascii") as f:
            return max(128, min(65535, int(f.read().strip())))
    except (OSError, ValueError):
        return 4096


def raise_fd_limit(workers: int) -> None:
    """One descriptor per worker connection, plus files: raise the soft limit up to the hard one."""
    import resource

    need = workers + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    new = need if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < need:
        log.error(
            "open-file limit %d is below the %d this job's %d workers need (one connection each). HINT: raise it (ulimit -n %d, or LimitNOFILE / limits.conf on the batch host)",
            new,
            need,
            workers,
            need,
        )


GC_THRESHOLDS = (20_000, 20, 20)


def settle_gc() -> None:
    """Start-up built what the job keeps (a record, a connection, buffers per worker): collect
    once, then freeze it out of the collector's sight, so that later collections scan only new
    objects (at 10k ranks full collections were 27-34 % of the loop, pauses up to 0.35 s), and
    collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
