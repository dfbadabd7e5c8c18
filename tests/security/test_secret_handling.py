"""The per-job secret: in the environment of the workers, never on a command line, never in logs.

Checked on the live job's real processes (/proc/<pid>/cmdline is what ``ps`` shows every user of
the node) and, for Slurm, on the argv and environment the launcher hands to srun.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from hydra import compose, initialize_config_module

from ckptless_hpc.control import wire
from ckptless_hpc.config import register_configs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_secret_is_not_on_any_command_line(live_job):
    secret = live_job.secret().encode()
    assert len(secret) == 64  # 32 random bytes, hex
    assert set(live_job.snapshot) == {"coordinator", "local0.0", "local1.0", "local2.0"}
    for name, info in live_job.snapshot.items():
        assert info.cmdline, name
        assert secret not in info.cmdline, f"the job secret is on the command line of {name} (pid {info.pid})"


def test_secret_environment_is_readable_by_the_job_user_only(live_job):
    """Workers hold the secret in their environment; /proc/<pid>/environ is owner-only (0400)."""
    secret = live_job.secret().encode()
    for name, info in live_job.snapshot.items():
        assert info.environ_mode == 0o400 and info.environ_uid == os.getuid(), (name, oct(info.environ_mode))
        if name != "coordinator":
            assert wire.SECRET_ENV.encode() + b"=" + secret in info.environ.split(b"\0"), name
    # the coordinator generates it in memory: it is not in the coordinator's own environment
    assert secret not in (live_job.snapshot["coordinator"].environ or b"")


def test_secret_is_not_written_to_the_run_directory(live_job):
    secret = live_job.secret()
    assert live_job.finish() == 0, live_job.output()
    assert secret not in live_job.output()
    files = [p for p in live_job.run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "events.jsonl" for p in files) and any(p.suffix == ".log" for p in files)
    leaks = [str(p) for p in files if secret in p.read_text(errors="replace")]
    assert not leaks, f"the job secret was written to {leaks}"


def test_slurm_worker_steps_get_the_secret_in_their_environment_only(tmp_path, monkeypatch):
    """cluster=slurm: the secret goes into srun's environment, not into srun's argv."""
    from ckptless_hpc.launch.slurm import SlurmLauncher
    from ckptless_hpc.slurm.env import SlurmEnvironment

    register_configs()
    with initialize_config_module(config_module="ckptless_hpc.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["cluster=slurm", "cluster.partition=debug", "cluster.time_min=5"])
    secret = wire.new_secret()
    calls = []

    class _Proc:
        returncode = 0
        pid = os.getpid()  # the launcher records the identity of what it starts (a real process)

        async def wait(self) -> int:
            return 0

    async def fake_exec(*argv, **kw):
        calls.append((list(argv), kw.get("env")))
        return _Proc()

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    launcher = SlurmLauncher(cfg, str(tmp_path), "1234", SlurmEnvironment({}), secret)

    asyncio.run(launcher.start_node("n1", 2, "10.0.0.1:5000", lambda wid, rc: None))
    (argv, env), = calls
    assert argv[0] == "srun" and "ckptless_hpc.worker" in argv
    assert not any(secret in a for a in argv), argv
    assert env[wire.SECRET_ENV] == secret
