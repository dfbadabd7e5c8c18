"""Run a job's coordinator in this process and print the human summary at the end."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import uuid
from typing import Any, Dict, Optional

from ..coordinator.shell import Coordinator
from ..control.wire import new_secret
from ..rundir.paths import RunPaths
from ..rundir.record import RecordFileHandler

log = logging.getLogger("ckptless_hpc")


class JobContext(logging.Filter):
    """Stamps the coordinator's log records with the job's generation and last committed step
    (``-`` until training starts), as worker lines carry theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.coordinator: Optional[Coordinator] = None

    def filter(self, record: logging.LogRecord) -> bool:
        c = self.coordinator
        gen = c.gen if c is not None and c.gen >= 0 else "-"
        step = c.steps.last_step if c is not None and c.steps.last_step is not None else "-"
        record.gen, record.step = gen, step
        return True


def setup_logging(run_dir: str, job_id: str) -> JobContext:
    """Console + ``coordinator.log``; set the returned filter's ``coordinator`` once it exists."""
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s job={job_id} gen=%(gen)s step=%(step)s %(name)s: %(message)s")
    context = JobContext()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler(sys.stdout)
    logfile = RecordFileHandler(RunPaths(run_dir).coordinator_log)  # a full disk: said once, the console goes on
    for h in (console, logfile):
        h.setFormatter(fmt)
        h.addFilter(context)
        root.addHandler(h)
    root.setLevel(logging.INFO)
    return context


def run_local(cfg: Any, run_dir: str) -> int:
    from .local import LocalLauncher

    os.makedirs(run_dir, exist_ok=True)
    job_id = f"local-{uuid.uuid4().hex[:8]}"
    context = setup_logging(run_dir, job_id)
    secret = new_secret()
    launcher = LocalLauncher.from_config(cfg, run_dir, secret)
    coord = context.coordinator = Coordinator.from_config(cfg, run_dir, launcher, secret, job_id)
    coord.record.resume = resume_record(cfg)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, coord.request_cancel, f"cancelled by {signal.Signals(sig).name}")
        return await coord.run()

    code = asyncio.run(main())
    print(human_summary(coord.summary))
    return code


def resume_record(cfg: Any) -> Optional[Dict[str, Any]]:
    """``resume_from``: the copy a new job starts from (state/export.py), for this job's layout."""
    if not cfg.get("resume_from"):
        return None
    from ..config import resume_shards
    from ..state.export import resume_record as record

    rec = record(str(cfg.resume_from), resume_shards(cfg))
    log.info("resuming from %s: the state of step %d", rec["path"], rec["step"])
    return rec


def human_summary(s: Dict[str, Any]) -> str:
    lines = [
        "",
        f"== ckptless_hpc job {s['job']}: {s['status']} (exit {s['exit_code']}) ==",
        f"steps        {s['steps_completed']}/{s['steps_requested']}   final loss {s['final_loss']}",
        f"wall         {s['wall_s']:.2f}s after {s['startup_s']:.2f}s start-up   goodput {100 * s['goodput']:.1f}%",
        f"state sha256 {s['final_state_sha256']}",
        f"recoveries   {len(s['recoveries'])}",
    ]
    final = s.get("final") or {}
    if final.get("model"):
        lines.append(f"model        {final['model']['path']} (sha256 {final['model']['sha256'][:16]}); whole state in {final['state']['path']}")
    if s.get("eval"):
        lines.insert(4, f"eval         step {s['eval']['step']}: " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(s["eval"]["metrics"].items())))
    degraded = s.get("degraded") or {}
    if degraded.get("spans"):
        spans = ", ".join(f"steps {d['from_step']}-{d['to_step']} on {d['processes']} processes ({d['seconds']:.2f}s)" for d in degraded["spans"])
        lines.append(f"degraded     {degraded['seconds']:.2f}s: {spans}; workers {s['workers']}")
    for r in s["recoveries"]:
        what = r["replacements"] or "shrunk: the survivors train the lost ranks"
        head = f"ranks {r['failed_ranks']} on {','.join(r['failed_nodes'])} -> {what}" if r["failed_ranks"] else f"grown back: {what}"
        lines.append(
            f"  gen {r['gen']}: {head} at step {r['target_step']}: "
            f"downtime {r['downtime_s']:.2f}s (detect {r['detect_s']:.2f} + reconfigure {r['reconfigure_s']:.2f} + "
            f"transfer {r['transfer_s']:.2f} + resume {r['resume_s']:.2f}), {r['bytes_transferred'] / 1e6:.1f} MB moved, "
            f"survivors restarted {r['survivors_restarted']}"
        )
    if s.get("error"):
        lines.append(f"error        {s['error']}")
    lines += [f"NOT RECORDED {why}" for why in s.get("record_errors") or ()]
    lines.append(f"run dir      {s['run_dir']}")
    return "\n".join(lines)
