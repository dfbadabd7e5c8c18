"""Run a job's coordinator in this process and print the human summary at the end."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import uuid
from typing import Any, Dict

from ..coordinator.server import Coordinator
from ..protocol import new_secret

log = logging.getLogger("ckptless_hpc")


def setup_logging(run_dir: str, job_id: str) -> None:
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s job={job_id} %(name)s: %(message)s")
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    logfile = logging.FileHandler(os.path.join(run_dir, "coordinator.log"))
    logfile.setFormatter(fmt)
    root.addHandler(console)
    root.addHandler(logfile)
    root.setLevel(logging.INFO)


def run_local(cfg: Any, run_dir: str) -> int:
    from .local import LocalLauncher

    os.makedirs(run_dir, exist_ok=True)
    job_id = f"local-{uuid.uuid4().hex[:8]}"
    setup_logging(run_dir, job_id)
    secret = new_secret()
    launcher = LocalLauncher.from_config(cfg, run_dir, secret)
    coord = Coordinator(cfg, run_dir, launcher, secret, job_id)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, coord.request_cancel, f"cancelled by {signal.Signals(sig).name}")
        return await coord.run()

    code = asyncio.run(main())
    print(human_summary(coord.summary))
    return code


def human_summary(s: Dict[str, Any]) -> str:
    lines = [
        "",
        f"== ckptless_hpc job {s['job']}: {s['status']} (exit {s['exit_code']}) ==",
        f"steps        {s['steps_completed']}/{s['steps_requested']}   final loss {s['final_loss']}",
        f"wall         {s['wall_s']:.2f}s after {s['startup_s']:.2f}s start-up   goodput {100 * s['goodput']:.1f}%",
        f"state sha256 {s['final_state_sha256']}",
        f"recoveries   {len(s['recoveries'])}",
    ]
    for r in s["recoveries"]:
        lines.append(
            f"  gen {r['gen']}: ranks {r['failed_ranks']} on {','.join(r['failed_nodes'])} -> {r['replacements']} at step {r['target_step']}: "
            f"downtime {r['downtime_s']:.2f}s (detect {r['detect_s']:.2f} + reconfigure {r['reconfigure_s']:.2f} + "
            f"transfer {r['transfer_s']:.2f} + resume {r['resume_s']:.2f}), {r['bytes_transferred'] / 1e6:.1f} MB moved, "
            f"survivors restarted {r['survivors_restarted']}"
        )
    if s.get("error"):
        lines.append(f"error        {s['error']}")
    lines.append(f"run dir      {s['run_dir']}")
    return "\n".join(lines)
