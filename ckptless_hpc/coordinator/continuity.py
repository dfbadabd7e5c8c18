"""Survivor continuity, measured from outside the control connection.

A survivor that restarted could not reconnect under the same worker id, so the control
connection alone can never see a restart. The launcher can: it started every worker's process
itself (local: the worker's process; Slurm: the node's ``srun`` step on the batch host) and
records its identity at launch, (pid, start time in clock ticks since boot from
``/proc/<pid>/stat``, and on Slurm the step id); at the end of each recovery the coordinator
asks for the identity of every survivor again and compares. A pid reused by another process
has another start time; a worker relaunched has another pid (or, on Slurm, another step).

The comparison is pure (``compare``); reading ``/proc`` is ``proc_identity``.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

Identity = Tuple[int, ...]  # (pid, start ticks[, Slurm step id])


def parse_start_ticks(stat: str) -> int:
    """Field 22 of ``/proc/<pid>/stat`` (starttime), read past the command name, which may hold
    spaces and parentheses."""
    fields = stat.rpartition(")")[2].split()
    return int(fields[19])  # fields[0] is field 3 (state)


def proc_identity(pid: Optional[int]) -> Optional[Identity]:
    """(pid, start ticks) of a live process; None when it is gone or a zombie."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
        return None
    return (pid, parse_start_ticks(stat))


def compare(launched: Mapping[str, Optional[Sequence[int]]], now: Mapping[str, Optional[Sequence[int]]]) -> Tuple[Dict[str, str], List[str]]:
    """(restarted worker -> why, unmeasured workers): a survivor whose process is not the one
    launched for it has restarted; one with no identity recorded at launch cannot be judged."""
    restarted: Dict[str, str] = {}
    unmeasured: List[str] = []
    for w, before in sorted(launched.items()):
        if before is None:
            unmeasured.append(w)
            continue
        after = now.get(w)
        if after is None:
            restarted[w] = f"its launched process (pid {before[0]}) is gone"
        elif tuple(after) != tuple(before):
            restarted[w] = f"launched as {tuple(before)}, now {tuple(after)}"
    return restarted, unmeasured
