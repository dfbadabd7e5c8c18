"""The worker process's entry point (``python -m ckptless_hpc.worker``, the zygote's forked
children, a Slurm node task): parse the command line, set up the log lines' context, and run
the agent (:mod:`.agent`) until it exits."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Any, Dict, List, Optional

from ..control import wire
from ..control.client import exit_now
from .agent import Address, Agent

log = logging.getLogger("ckptless_hpc.worker")


class _Context(logging.Filter):
    """Stamps every log record with job, generation, rank, node and step."""

    def __init__(self, fields: Dict[str, Any]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for k, v in self.fields.items():
            setattr(record, k, v)
        return True


def _setup_logging(ctx: Dict[str, Any]) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context(ctx))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s job=%(job)s gen=%(gen)s rank=%(rank)s node=%(node)s step=%(step)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ckptless_hpc.worker", description="ckptless_hpc worker (started by the coordinator)")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator's control server")
    p.add_argument("--node", required=True, help="name of the node this worker runs on")
    p.add_argument("--local-index", default="0", help="index of this worker on its node, or 'slurm' (the task's SLURM_PROCID in its one-node step)")
    p.add_argument("--host", default="auto", help="address this worker binds and advertises; 'auto' = this node's address")
    p.add_argument("--relay", default=None, help="the node's relay socket (cluster.control=node): the control connection goes through it")
    args = p.parse_args(argv)
    if args.local_index == "slurm":
        from ..slurm.env import SlurmEnvironment

        local_index = SlurmEnvironment().procid or 0
    else:
        local_index = int(args.local_index)
    agent = Agent(Address(args.node, local_index, args.coordinator, wire.resolve_host(args.host), wire.load_secret(), relay=args.relay))
    _setup_logging(agent.ctx)
    try:
        agent.start()
        agent.serve_forever()
    except Exception:
        log.error("worker failed:\n%s", traceback.format_exc())
        exit_now(1)
