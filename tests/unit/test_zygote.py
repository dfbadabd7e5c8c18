"""The local backend's fork server (worker/zygote.py) with a real fork, and the launcher's end of
it (launch/local.py ``Zygote``): a tiny fake worker stands in for the worker's main, so that no
test here pays torch's import."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptless_hpc.launch.local import Zygote
from ckptless_hpc.launch.worker_argv import worker_command
from ckptless_hpc.worker import zygote

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]

FAKE = textwrap.dedent(
    """
    import os, sys, time

    def main(argv):
        print("fake", os.getpid(), os.getpgid(0), os.environ.get("FAKE_SECRET"), sorted(os.listdir("/proc/self/fd")), flush=True)
        print(open("/proc/self/cmdline", "rb").read(), flush=True)
        kind = argv[0]
        if kind == "exit":
            sys.exit(int(argv[1]))
        if kind == "message":
            sys.exit("a message, as sys.exit(str) gives")
        if kind == "raise":
            raise ValueError("boom")
        if kind == "sleep":
            time.sleep(float(argv[1]))
        if kind == "exit_now":
            os._exit(int(argv[1]))
    """
)


@pytest.fixture
def fake_env(tmp_path):
    (tmp_path / "fakeworker.py").write_text(FAKE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "FAKE_SECRET": "s3cret"}


def test_returncode_is_asyncios():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert zygote.returncode(os.waitpid(pid, 0)[1]) == 7
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    os.kill(pid, signal.SIGKILL)
    assert zygote.returncode(os.waitpid(pid, 0)[1]) == -signal.SIGKILL


def test_wire_is_one_json_line_per_message():
    data = zygote.encode({"id": 3, "argv": ["--node", "local0"], "log": "/x y.log", "pgid": 0})
    assert data.endswith(b"\n") and data.count(b"\n") == 1 and b" " not in data.replace(b"/x y", b"")


def _log(path: Path, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and b"\n" in path.read_bytes():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} stayed empty")


def test_forked_workers_exit_codes_groups_and_command_lines(tmp_path, fake_env):
    async def scenario():
        z = Zygote(fake_env, str(tmp_path), target="fakeworker:main")
        try:
            lead = await z.fork(["sleep", "30", "--node", "local0"], str(tmp_path / "lead.log"), 0, "lead")
            member = await z.fork(["sleep", "30"], str(tmp_path / "member.log"), lead.pid, "member")
            codes = [await z.fork(a, str(tmp_path / f"{a[0]}.log"), 0, a[0]) for a in (["exit", "3"], ["message"], ["raise"], ["exit_now", "5"], ["done"])]
            rcs = [await asyncio.wait_for(p.wait(), 20) for p in codes]
            assert rcs == [3, 1, 1, 5, 0] and [p.returncode for p in codes] == rcs
            lead_log = _log(tmp_path / "lead.log")
            _log(tmp_path / "member.log")
            assert os.getpgid(lead.pid) == lead.pid and os.getpgid(member.pid) == lead.pid  # the node's group, led by its first
            assert os.getpgid(lead.pid) not in (os.getpgid(0), os.getpgid(z.proc.pid))
            # what ps and the tools see: the worker's command line, no padding, the secret in the environment only
            cmd = Path(f"/proc/{lead.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            assert cmd == [sys.executable.encode(), b"-m", b"ckptless_hpc.worker", b"sleep", b"30", b"--node", b"local0"], cmd
            assert cmd == [a.encode() for a in worker_command(["sleep", "30", "--node", "local0"])], cmd  # the title is the exec'd worker's command line
            assert b"FAKE_SECRET=s3cret" in Path(f"/proc/{lead.pid}/environ").read_bytes().split(b"\0")
            ztitle = Path(f"/proc/{z.proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            assert ztitle[1:3] == [b"-m", b"ckptless_hpc.worker.zygote"] and not any(a.strip() == b"" for a in ztitle), ztitle
            assert "fake" in lead_log and "s3cret" in lead_log and "['0', '1', '2', '3']" in lead_log  # no pipe of the zygote's inherited
            assert "ValueError: boom" in (tmp_path / "raise.log").read_text()
            assert "a message" in (tmp_path / "message.log").read_text()
            os.killpg(lead.pid, signal.SIGKILL)  # a node killed: both of its workers
            assert await asyncio.wait_for(lead.wait(), 20) == -signal.SIGKILL
            assert await asyncio.wait_for(member.wait(), 20) == -signal.SIGKILL
            with pytest.raises(ProcessLookupError):
                lead.send_signal(signal.SIGKILL)  # reaped: gone
        finally:
            await z.close()
        assert z.proc.returncode == 0 and z.lost is None

    asyncio.run(scenario())


def test_eof_ends_the_zygote_not_its_workers(tmp_path, fake_env):
    async def scenario():
        z = Zygote(fake_env, str(tmp_path), target="fakeworker:main")
        child = await z.fork(["sleep", "30"], str(tmp_path / "w.log"), 0, "w")
        await z.close()
        return z, child.pid

    z, pid = asyncio.run(scenario())
    try:
        assert z.proc.returncode == 0
        os.kill(pid, 0)  # still alive: a worker leaves when it loses its coordinator, not its zygote
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_lost_zygote_fails_starts_loudly_and_exits_are_still_seen(tmp_path, fake_env):
    async def scenario():
        z = Zygote(fake_env, str(tmp_path), target="fakeworker:main")
        child = await z.fork(["sleep", "30"], str(tmp_path / "w.log"), 0, "w")
        z.proc.kill()
        deadline = time.monotonic() + 20
        while z.lost is None:
            assert time.monotonic() < deadline, "the zygote's death went unnoticed"
            await asyncio.sleep(0.05)
        assert "exited unexpectedly" in z.lost and "zygote.log" in z.lost
        with pytest.raises(RuntimeError, match="cannot start worker local3.0 of node local3: the worker zygote"):
            await z.fork(["sleep", "1"], str(tmp_path / "x.log"), 0, "worker local3.0 of node local3")
        os.kill(child.pid, signal.SIGKILL)
        assert await asyncio.wait_for(child.wait(), 20) is None  # seen gone from /proc; its code died with the zygote
        await z.close()

    asyncio.run(scenario())
