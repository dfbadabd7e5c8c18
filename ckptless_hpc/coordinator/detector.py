"""Failure detection by missed heartbeats: a pure function of (now, last seen, timeout)."""

from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Mapping, Tuple


def silent_workers(now: float, last_seen: Mapping[str, float], watched: Iterable[str], timeout_s: float) -> List[Tuple[str, str]]:
    """Watched workers not heard from for longer than ``timeout_s``, with a readable reason."""
    out = []
    for w in watched:
        seen = last_seen.get(w)
        if seen is not None and now - seen > timeout_s:
            out.append((w, f"no heartbeat for {now - seen:.1f}s (timeout {timeout_s:.1f}s)"))
    return out


def stragglers(compute_s: Mapping[int, float], factor: float) -> Dict[int, float]:
    """Ranks whose step compute time exceeds ``factor`` x the typical rank's (lower median).

    A straggler is alive and beating: it is reported, never declared dead.
    """
    times = [t for t in compute_s.values() if t and t > 0]
    if len(times) < 2:
        return {}
    typical = statistics.median_low(times)
    return {r: t / typical for r, t in compute_s.items() if t and t > factor * typical}
