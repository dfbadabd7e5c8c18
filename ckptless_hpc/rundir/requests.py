"""Requests to a running job through its run directory: ``ckptless-hpc drain`` writes one file
per request into ``RUN_DIR/requests/``, the coordinator takes them (renames them ``.taken``) on
its heartbeat tick. A file, not a socket: the run directory is what every host of a Slurm job
and the user's shell share, and a request written while the coordinator is busy waits safely."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

from .record import write_json

PENDING = ".json"
TAKEN = ".taken"


def write(folder: str, kind: str, **fields: Any) -> str:
    """One request (atomic: the coordinator never reads half a file); its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{kind}-{time.time_ns()}{PENDING}")
    write_json(path, {"kind": kind, "at": time.time(), **fields})
    return path


def take(folder: str) -> List[Dict[str, Any]]:
    """The pending requests, oldest first, each marked taken (a request is taken once). A file
    that cannot be read is taken too, with its error (a request is never retried forever)."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(PENDING))
    except OSError:  # no request yet: no folder
        return []
    out = []
    for n in names:
        path = os.path.join(folder, n)
        try:
            with open(path, encoding="utf-8") as f:
                req = json.load(f)
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            req = {"kind": "unreadable", "error": f"{n}: {e}"}
        try:
            os.replace(path, path[: -len(PENDING)] + TAKEN)
        except OSError:
            continue  # gone meanwhile: someone else took it
        req["file"] = n
        out.append(req)
    return out
