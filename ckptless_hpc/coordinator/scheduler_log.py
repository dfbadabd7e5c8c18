"""What a scheduler command's outcome (launch/background.py's report) becomes in the run record:
its event's fields and its log line. Pure: the coordinator and the launcher both read it here."""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple


def event_fields(outcome: Dict[str, Any]) -> Dict[str, Any]:
    """An outcome's fields for its ``scheduler_command`` event (job and worker are the event's own)."""
    return {k: v for k, v in outcome.items() if k not in ("job", "worker")}


def describe(outcome: Dict[str, Any], gen: Optional[int], rank: Optional[int], step: Optional[int]) -> Tuple[int, str]:
    """The log level and line of an outcome, naming generation, rank and training step."""
    what = f"{outcome['action']} (node {outcome.get('node')}, Slurm step {outcome.get('slurm_step')}, gen {gen}, rank {rank}, at step {step})"
    if outcome["ok"]:
        return logging.INFO, f"{what} took {outcome['seconds']:.2f}s, queued {outcome['waited_s']:.2f}s before"
    return logging.WARNING, f"{what} failed after {outcome['seconds']:.2f}s: {outcome['error']}"
