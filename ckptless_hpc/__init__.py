"""ckptless_hpc: checkpointless training on Slurm (hot spares, peer-to-peer recovery)."""

import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _source_checkout_conf() -> None:
    """In a source checkout the Hydra configs are the top-level ``conf/`` that the wheel ships as
    ``ckptless_hpc.conf``: bind that name to this checkout's ``conf/``, so that a run from a
    checkout (or a second worktree) never composes another checkout's configs, whatever an
    editable install points at. An installed wheel has ``ckptless_hpc/conf`` and is untouched."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    conf = _os.path.join(_os.path.dirname(here), "conf", "__init__.py")
    if "ckptless_hpc.conf" in _sys.modules or _os.path.isdir(_os.path.join(here, "conf")) or not _os.path.isfile(conf):
        return
    spec = _util.spec_from_file_location("ckptless_hpc.conf", conf, submodule_search_locations=[_os.path.dirname(conf)])
    if spec is None or spec.loader is None:
        return
    module = _util.module_from_spec(spec)
    _sys.modules["ckptless_hpc.conf"] = module
    spec.loader.exec_module(module)


_source_checkout_conf()
