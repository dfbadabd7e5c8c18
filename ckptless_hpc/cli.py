"""The Hydra entry point: ``python -m ckptless_hpc [overrides]`` and the ``ckptless-hpc`` script."""

from __future__ import annotations

import sys
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hydra.experimental.callback import Callback

from .config import ConfigError, register_configs, validate

register_configs()

EXIT_CONFIG = 2


@hydra.main(version_base="1.3", config_path="pkg://ckptless_hpc.conf", config_name="config")
def main(cfg: DictConfig) -> int:
    try:
        validate(cfg)
    except ConfigError as e:
        print(f"ckptless_hpc: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    run_dir = HydraConfig.get().runtime.output_dir
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


TOOLS = ("report", "status", "logs", "cancel")


def entry() -> None:
    """``ckptless-hpc [overrides]`` runs a job; ``ckptless-hpc report|status|logs|cancel ...`` inspects one."""
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        from .tools import main as tools_main

        sys.exit(tools_main(sys.argv[1:]))
    main()
