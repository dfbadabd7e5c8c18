"""The Hydra entry point: ``python -m ckptless_hpc [overrides]`` and the ``ckptless-hpc`` script."""

from __future__ import annotations

import sys
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig

from hydra.experimental.callback import Callback

from .config import ConfigError, register_configs, validate
from .launch.probes import PROBES
from .rundir.record import make_private

register_configs()

EXIT_CONFIG = 2


@hydra.main(version_base="1.3", config_path="pkg://ckptless_hpc.conf", config_name="config")
def main(cfg: DictConfig) -> int:
    try:
        validate(cfg, PROBES)  # the checks that need state/ (launch/probes.py)
    except ConfigError as e:
        print(f"ckptless_hpc: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    run_dir = HydraConfig.get().runtime.output_dir
    make_private(run_dir)
    if cfg.dry_run:
        from .launch.dryrun import dry_run

        code = dry_run(cfg, run_dir)
        if code != 0:
            sys.exit(code)
        return code
    if cfg.cluster.backend == "slurm":
        from .launch.slurm import submit

        return submit(cfg, run_dir)
    from .launch.run import run_local

    code = run_local(cfg, run_dir)
    if code != 0:
        sys.exit(code)
    return code


class SweepTable(Callback):
    """After ``-m`` with cluster=slurm: one line per submitted job (job id, run dir, overrides)."""

    def __init__(self) -> None:
        self.rows: list = []

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        value = getattr(job_return, "_return_value", None)
        if isinstance(value, dict) and "job_id" in value:
            self.rows.append((value["job_id"], value["run_dir"], " ".join(job_return.overrides or [])))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.rows:
            print(f"\n{'job id':>10}  {'run dir':<50}  overrides")
            for job_id, run_dir, overrides in self.rows:
                print(f"{job_id:>10}  {run_dir:<50}  {overrides}")


TOOLS = ("report", "status", "logs", "cancel", "drain", "export")


def entry() -> None:
    """``ckptless-hpc [overrides]`` runs a job; ``ckptless-hpc report|status|logs|cancel|drain|export ...`` inspects or acts on one."""
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        from .tools.commands import main as tools_main

        sys.exit(tools_main(sys.argv[1:]))
    try:
        main()
    except SystemExit as e:  # Hydra reports a config it cannot compose, then exits 1: that is exit 2 here
        if e.code == 1 and isinstance(e.__context__, _COMPOSITION_ERRORS):
            _composition_failed(e.__context__)
        raise
    except _COMPOSITION_ERRORS as e:  # HYDRA_FULL_ERROR=1: Hydra re-raised it (with its traceback, below)
        _composition_failed(e)


_COMPOSITION_ERRORS = (ConfigCompositionException, OverrideParseException)


def _composition_failed(e: BaseException) -> None:
    """An unknown key, a value of the wrong type, an unknown config group option or a malformed
    override: Hydra has said what (above); add the field and the HINT, and exit 2 as
    validation does (docs/failure-semantics.md)."""
    cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__) else e
    key = getattr(cause, "full_key", None)
    what = (str(cause).splitlines() or [type(cause).__name__])[0].rstrip(".")
    print(
        f"ckptless_hpc: invalid configuration: {f'{key}: ' if key else ''}{what}. "
        "HINT: check the key's spelling and the value's type against docs/configuration.md; "
        "`python -m ckptless_hpc --cfg job` prints every key with its value",
        file=sys.stderr,
    )
    sys.exit(EXIT_CONFIG)
