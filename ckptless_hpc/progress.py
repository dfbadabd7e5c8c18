"""Live progress of a job: a tqdm bar on a terminal, plain periodic log lines otherwise.

Shown by the coordinator: in the terminal that launched a local run, in the coordinator's log
(and the job's output file) on Slurm, where lines keep the log readable. The console also
echoes one rank's own log lines (``train.console_rank``), read from its log file.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

log = logging.getLogger("ckptless_hpc.progress")


@dataclass
class Snapshot:
    step: int
    total: int
    loss: float
    samples_per_s: Optional[float]
    steps_per_s: float
    alive: int
    world: int
    spares: int
    recoveries: int
    goodput: float
    gen: int
    metrics: Optional[Dict[str, float]] = None  # the task's own, next to the loss

    def line(self) -> str:
        rate = f"{self.samples_per_s:.0f} samples/s" if self.samples_per_s else f"{self.steps_per_s:.1f} steps/s"
        own = "".join(f" {k} {v:.4g}" for k, v in sorted((self.metrics or {}).items()))
        return (
            f"step {self.step}/{self.total} loss {self.loss:.4f}{own} | {rate} | workers {self.alive}/{self.world}{' (degraded)' if self.alive < self.world else ''} "
            f"spares {self.spares} | recoveries {self.recoveries} | goodput {100 * self.goodput:.1f}% | gen {self.gen}"
        )


class Progress:
    def __init__(self, total: int, log_every: int, tty: Optional[bool] = None) -> None:
        self.total = total
        self.log_every = log_every
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)

    def update(self, snap: Snapshot) -> None:
        if self._bar is not None:
            self._bar.n = snap.step
            self._bar.set_postfix_str(snap.line().split(" | ", 1)[1] + f" | loss {snap.loss:.3f}", refresh=True)
        elif snap.step % self.log_every == 0 or snap.step == self.total:
            log.info(snap.line())

    def note(self, line: str) -> None:
        """A line of its own (an evaluation's results): above the bar, or logged."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            log.info(line)

    def echo(self, lines: List[str]) -> None:
        """Print a worker's log lines on the console, above the bar when there is one."""
        if not lines:
            return
        if self._bar is not None:
            for line in lines:
                self._bar.write(line, file=sys.stdout)
        else:
            sys.stdout.write("".join(line + "\n" for line in lines))
            sys.stdout.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class LogTail:
    """The complete lines appended to a log file since the last read. A new path (the rank moved
    to a replacement worker) gives the old file's last lines, then the new one from its top."""

    def __init__(self, max_bytes: int = 1 << 20) -> None:
        self.path: Optional[str] = None
        self.offset = 0
        self.partial = b""
        self.max_bytes = max_bytes

    def read(self, path: Optional[str]) -> List[str]:
        lines: List[str] = []
        if path != self.path:
            lines += self._new_lines()  # what the previous holder wrote before it was replaced
            self.path, self.offset, self.partial = path, 0, b""
        return lines + self._new_lines()

    def _new_lines(self) -> List[str]:
        if self.path is None:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(self.max_bytes)
        except OSError:
            return []  # not written yet
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line.decode("utf-8", errors="replace").rstrip("\r") for line in lines]


class ConsoleEcho:
    """The console shows the log lines of whichever worker holds the console rank now:
    ``log_path()`` names its log file (None: no such rank yet), read as it grows."""

    def __init__(self, progress: Progress, log_path: Callable[[], Optional[str]], tail: Optional[LogTail] = None) -> None:
        self.progress = progress
        self.log_path = log_path
        self.tail = tail or LogTail()

    def once(self) -> None:
        """Echo what was written since the last call."""
        self.progress.echo(self.tail.read(self.log_path()))

    async def follow(self, stopping: Callable[[], bool], every_s: float = 0.25) -> None:
        """Echo every ``every_s`` until ``stopping()``."""
        while not stopping():
            await asyncio.sleep(every_s)
            self.once()
