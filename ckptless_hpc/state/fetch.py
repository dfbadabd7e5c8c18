"""Fetching a part of one step's state from the peers the coordinator named, several at once.

A part (``transfer.Want``: all of the state, the parameters a step needs first, or the optimizer
state behind them) is cut into as many disjoint groups as there are sources, at most
``parallel`` (:func:`transfer.select`: contiguous entries balanced by bytes, the same cut on every
replica), and group ``i`` is fetched from source ``i``, all at once: on a cluster each source
sends over its own node's link, so their rates add up until the receiver's link is full. Each
group is checked on its own (xxh3-64 of its bytes, the step it holds, the metadata equal to the
other groups'); a group that fails (damaged, truncated, refused, its source gone mid-way) is
fetched again from the next source (:func:`source_for`), after a short jittered pause (a source
refusing because it is busy may have a slot free by then), up to ``rounds`` times over the
sources. When a group fails every attempt, the error names the sources that failed it
(``TransferError.sources``): the coordinator blames them, not the fetcher. What comes back is the part's entries in canonical order, as if fetched from one source.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..control.wire import backoff_s
from .transfer import Arena, Received, TransferError, Want, fetch_part

ROUNDS = 3  # attempts of a group = ROUNDS x the number of sources
RETRY_BASE_S, RETRY_CAP_S = 0.05, 1.0  # the pause before a group's next attempt (full jitter, doubling)


@dataclass(frozen=True)
class Source:
    worker: str
    host: str
    port: int

    @classmethod
    def of(cls, msg: Dict[str, Any]) -> "Source":
        return cls(str(msg.get("worker")), str(msg["host"]), int(msg["port"]))


def groups_for(n_sources: int, parallel: int) -> int:
    """How many groups a part is cut into: one per source, at most ``parallel`` (pure)."""
    return max(1, min(n_sources, parallel))


def source_for(group: int, attempt: int, n_sources: int) -> int:
    """The source of ``group``'s ``attempt``-th try: its own first, then the next ones (pure)."""
    return (group + attempt) % n_sources


# (source, want, error) -> None: told of every failed attempt (the worker reports it)
OnError = Callable[[Source, Want, TransferError], None]


@dataclass
class Fetched:
    """A part, verified, with who sent what."""

    received: Received
    by_source: Dict[str, int]  # worker -> bytes it sent
    attempts: int


def fetch(
    sources: Sequence[Source],
    secret: str,
    want: Want,
    timeout_s: float,
    arena: Optional[Arena] = None,
    parallel: int = 4,
    on_error: Optional[OnError] = None,
    before_attempt: Optional[Callable[[], None]] = None,
    rounds: int = ROUNDS,
) -> Fetched:
    """``want`` (a part; its index/of are set here) from ``sources``, in ``groups_for`` groups at
    once; raises TransferError naming every failed attempt when a group could not be had."""
    if not sources:
        raise TransferError(f"step {want.step} needed but the coordinator named no source")
    t0 = time.monotonic()
    of = groups_for(len(sources), parallel)
    results: List[Optional[Received]] = [None] * of
    senders: List[str] = [""] * of
    errors: List[str] = []
    failed_by: Dict[str, None] = {}  # sources of the failed attempts, in order
    attempts = [0]
    lock = threading.Lock()

    def one(group: int) -> None:
        part = replace(want, index=group, of=of)
        rng = random.Random()
        for attempt in range(rounds * len(sources)):
            if attempt:
                time.sleep(backoff_s(attempt - 1, rng, RETRY_BASE_S, RETRY_CAP_S))
            src = sources[source_for(group, attempt, len(sources))]
            if before_attempt is not None:
                before_attempt()
            with lock:
                attempts[0] += 1
            try:
                results[group] = fetch_part(src.host, src.port, secret, part, timeout_s, arena)
                senders[group] = src.worker
                return
            except TransferError as e:
                with lock:
                    errors.append(f"{part.describe()} from {src.worker}: {e}")
                    failed_by[src.worker] = None
                if on_error is not None:
                    on_error(src, part, e)

    threads = [threading.Thread(target=one, args=(g,), name=f"fetch-{want.part}-{g}", daemon=True) for g in range(1, of)]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join()
    missing = [g for g, r in enumerate(results) if r is None]
    if missing:
        raise TransferError(f"{want.describe()} of step {want.step}: group(s) {missing} of {of} failed every attempt: " + "; ".join(errors), tuple(failed_by))
    got = [r for r in results if r is not None]
    for g, r in enumerate(got[1:], start=1):
        if r.meta != got[0].meta:  # replicas of one step hold the same metadata; anything else is a divergence
            raise TransferError(f"{want.describe()} of step {want.step}: {senders[g]}'s metadata differs from {senders[0]}'s")
    by_source: Dict[str, int] = {}
    for s, r in zip(senders, got):
        by_source[s] = by_source.get(s, 0) + r.nbytes
    entries = [e for r in got for e in r.entries]
    return Fetched(Received(entries, got[0].meta, sum(r.nbytes for r in got), time.monotonic() - t0), by_source, attempts[0])


class Behind:
    """A part fetched in a thread of its own while the caller trains (the optimizer state behind
    the first step's forward and backward); ``result()`` once ``done``."""

    def __init__(self, start: Callable[[], Fetched]) -> None:
        self._start = start
        self._box: Dict[str, Any] = {}
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.t_start: Optional[float] = None
        self.t_done: Optional[float] = None
        self.on_done: Callable[[], None] = lambda: None

    def start(self) -> None:
        if self._thread is not None:
            return
        self.t_start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="fetch-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._box["value"] = self._start()
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._box["error"] = e
        finally:
            self.t_done = time.monotonic()
            self._done.set()
            self.on_done()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Fetched:
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]
