"""Slurm's environment variables and node lists: pure, no subprocess.

`SlurmEnvironment` is the one place in the project that reads ``SLURM_*`` variables.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TAIL_NUM_RE = re.compile(r"^(.*?)(\d+)$")


# Set by the coordinator for the workers it starts in a companion job (cluster.grow=job): the job
# they serve (which they save and requeue when its coordinator is gone) and its requeue count.
SERVED_JOB_ENV = "CKPTLESS_SLURM_JOB_ID"
SERVED_RESTARTS_ENV = "CKPTLESS_SLURM_RESTART_COUNT"


class SlurmEnvironment:
    """Read-only view of the Slurm variables of one process.

    Built from a mapping (default: a snapshot of ``os.environ``), so tests pass dicts.
    Properties are lazy: a malformed variable fails only when it is read.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._env = dict(os.environ if environ is None else environ)

    def __repr__(self) -> str:
        return f"SlurmEnvironment(job_id={self.job_id!r}, nodename={self.nodename!r})"

    @property
    def in_job(self) -> bool:
        """True inside an allocation (batch script, srun step or salloc shell)."""
        return self.job_id is not None

    @property
    def job_id(self) -> str | None:
        """The job this process serves: ``SLURM_JOB_ID`` (older Slurm: ``SLURM_JOBID``), or for a
        worker started in a companion job (``cluster.grow=job``) the job it joined; None outside Slurm."""
        return self._first(SERVED_JOB_ENV, "SLURM_JOB_ID", "SLURM_JOBID")

    def require_job_id(self) -> str:
        """The job id, or a ValueError that says how to get one."""
        job_id = self.job_id
        if job_id is None:
            raise ValueError("SLURM_JOB_ID is not set: this process is not inside a Slurm job. HINT: run it from an sbatch script or srun, or use cluster=local.")
        return job_id

    @property
    def restart_count(self) -> int:
        """``SLURM_RESTART_COUNT``: 0 on the first run, 1, 2, ... after each requeue."""
        return self._int(SERVED_RESTARTS_ENV, "SLURM_RESTART_COUNT", default=0) or 0  # a companion job's worker: the served job's

    @property
    def nodename(self) -> str | None:
        """``SLURMD_NODENAME``: the Slurm node name (hostnames may differ from it)."""
        return self._first("SLURMD_NODENAME")

    @property
    def job_nodelist(self) -> str | None:
        """``SLURM_JOB_NODELIST`` as Slurm wrote it, e.g. ``n[1-4]``.

        Stale after a node failure: ask ``commands.live_nodes`` for the current set.
        """
        return self._first("SLURM_JOB_NODELIST", "SLURM_NODELIST")

    @property
    def job_nodes(self) -> list[str]:
        """The expanded job node list at job start ([] outside Slurm)."""
        raw = self.job_nodelist
        return [] if raw is None else expand_nodelist(raw)

    @property
    def step_id(self) -> int | None:
        """``SLURM_STEP_ID``; None in the batch script and outside steps."""
        return self._int("SLURM_STEP_ID", "SLURM_STEPID")

    @property
    def procid(self) -> int | None:
        """``SLURM_PROCID``: global task rank inside the step."""
        return self._int("SLURM_PROCID")

    @property
    def ntasks(self) -> int | None:
        """``SLURM_NTASKS``. Never pass it on to srun: render explicit --ntasks."""
        return self._int("SLURM_NTASKS", "SLURM_NPROCS")

    @property
    def submit_dir(self) -> str | None:
        """``SLURM_SUBMIT_DIR``: the working directory of sbatch."""
        return self._first("SLURM_SUBMIT_DIR")

    def _first(self, *names: str) -> str | None:
        for name in names:
            value = self._env.get(name)
            if value is not None and value.strip() != "":
                return value.strip()
        return None

    def _int(self, *names: str, default: int | None = None) -> int | None:
        for name in names:
            value = self._first(name)
            if value is not None:
                return _parse_int(name, value)
        return default


def _parse_int(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"{name} must be a non-negative integer, saw {value!r}. HINT: unset {name} or let Slurm set it; do not export it by hand.")
    return number


def expand_nodelist(nodelist: str) -> list[str]:
    """``"n[1-3,5],gpu[01-02]"`` -> ``["n1", "n2", "n3", "n5", "gpu01", "gpu02"]``.

    Handles zero padding, several bracket groups in one name (cartesian product, as
    Slurm does) and commas at the top level. Order is kept; duplicates are kept.
    """
    names: list[str] = []
    for item in _split_top_level(nodelist):
        names.extend(_expand_item(item, nodelist))
    return names


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise _nodelist_error(nodelist, f"nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _nodelist_error(nodelist, f"']' without '[' at position {i}")
        elif char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise _nodelist_error(nodelist, "'[' is never closed")
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip() != ""]


def _expand_item(item: str, nodelist: str) -> list[str]:
    """One top-level item, e.g. ``rack[1-2]-n[01-03]``."""
    open_at = item.find("[")
    if open_at < 0:
        _check_name(item, nodelist)
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    rests = _expand_item(tail, nodelist) if tail else [""]
    names = [head + number + rest for number in _expand_ranges(body, nodelist) for rest in rests]
    _check_name(names[0], nodelist)
    return names


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]``; the width of the lower bound pads."""
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE_RE.match(part.strip())
        if match is None:
            raise _nodelist_error(nodelist, f"bad range {part!r} inside '[{body}]'")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _nodelist_error(nodelist, f"range {part!r} goes downwards")
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers


def _check_name(name: str, nodelist: str) -> None:
    if not _NAME_RE.match(name):
        raise _nodelist_error(nodelist, f"bad node name {name!r}")


def _nodelist_error(nodelist: str, what: str) -> ValueError:
    return ValueError(
        f"cannot expand Slurm node list {nodelist!r}: {what}. HINT: expected names or bracket ranges such as 'n[1-3,5],gpu[01-02]' (what `scontrol show hostnames` accepts)."
    )


def compress_nodelist(names: Iterable[str]) -> str:
    """``["n1", "n2", "n3", "n5"]`` -> ``"n[1-3,5]"``: sorted, duplicates dropped.

    Only the trailing number of a name is bracketed. ``expand_nodelist`` inverts it
    (up to order and duplicates).
    """
    names = list(names)
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    padded = _padded_widths(names)
    for name in names:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"cannot compress node names: bad node name {name!r}. HINT: pass single node names such as 'n1', not lists like 'n[1-2]' or 'n1,n2'.")
        match = _TAIL_NUM_RE.match(name)
        if match is None:
            plain.add(name)
            continue
        prefix, digits = match.group(1), match.group(2)
        width = len(digits) if (prefix, len(digits)) in padded else 0
        groups.setdefault((prefix, width), set()).add(int(digits))
    parts = [(name, 0, name) for name in plain]
    parts += [(prefix, min(nums), _bracket(prefix, width, nums)) for (prefix, width), nums in groups.items()]
    return ",".join(text for _, _, text in sorted(parts))


def _padded_widths(names: list[str]) -> set[tuple[str, int]]:
    """(prefix, width) of every zero-padded trailing number, e.g. ("gpu", 2) for gpu01."""
    widths = set()
    for name in names:
        match = _TAIL_NUM_RE.match(name)
        if match and len(match.group(2)) > 1 and match.group(2).startswith("0"):
            widths.add((match.group(1), len(match.group(2))))
    return widths


def _bracket(prefix: str, width: int, numbers: set[int]) -> str:
    ordered = sorted(numbers)
    if len(ordered) == 1:
        return prefix + str(ordered[0]).zfill(width)
    runs: list[list[int]] = []
    for number in ordered:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    text = ",".join(_run_text(low, high, width) for low, high in runs)
    return f"{prefix}[{text}]"


def _run_text(low: int, high: int, width: int) -> str:
    if low == high:
        return str(low).zfill(width)
    return f"{str(low).zfill(width)}-{str(high).zfill(width)}"
