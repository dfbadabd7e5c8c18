"""What ``config.validate`` needs from the layers above the schema, passed in as ``Probes``.

``config.py`` is the bottom layer: it may not import ``state`` (the layout arithmetic, reading a
saved state, torch). Whoever validates a config before a job (the CLI, the benchmarks) passes
``PROBES``, so the checks run exactly as when config.py imported them lazily.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..config import Probes
from ..state.placement import hsdp_tolerance


def read_resume(path: str, shards: int) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """(the record ``resume_from=path`` loads, None), or (None, why it cannot be read)."""
    from ..state.export import ExportError, resume_record  # torch: only when resuming

    try:
        return resume_record(path, shards), None
    except ExportError as e:
        return None, str(e)


PROBES = Probes(hsdp_tolerance=hsdp_tolerance, read_resume=read_resume)
