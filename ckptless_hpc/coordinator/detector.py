"""Failure detection by missed heartbeats: a pure function of (now, last seen, timeout)."""

from __future__ import annotations

from typing import Iterable, List, Mapping, Tuple


def silent_workers(now: float, last_seen: Mapping[str, float], watched: Iterable[str], timeout_s: float) -> List[Tuple[str, str]]:
    """Watched workers not heard from for longer than ``timeout_s``, with a readable reason."""
    out = []
    for w in watched:
        seen = last_seen.get(w)
        if seen is not None and now - seen > timeout_s:
            out.append((w, f"no heartbeat for {now - seen:.1f}s (timeout {timeout_s:.1f}s)"))
    return out
