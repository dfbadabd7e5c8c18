"""rundir/paths.py: the run directory's layout, pinned (a renamed file breaks every reader of
old run directories and every tool a user scripted: a rename must be deliberate)."""

import os

import pytest

from ckptless_hpc.rundir import paths
from ckptless_hpc.rundir.paths import RunPaths

pytestmark = pytest.mark.timeout(30)


def test_layout_is_the_one_jobs_leave():
    p = RunPaths("/r")
    assert (p.events, p.summary, p.restart, p.job, p.coordinator_log) == ("/r/events.jsonl", "/r/summary.json", "/r/restart.json", "/r/job.json", "/r/coordinator.log")
    assert (p.logs, p.worker_log("n1.0"), p.relay_log("n1"), p.srun_log("n1"), p.node_task_log("n1"), p.zygote_log) == (
        "/r/logs", "/r/logs/n1.0.log", "/r/logs/relay-n1.log", "/r/logs/srun-n1.log", "/r/logs/n1.%t.log", "/r/logs/zygote.log",
    )
    assert (p.hydra, p.hydra_config, p.hydra_overrides, p.submitit) == ("/r/.hydra", "/r/.hydra/config.yaml", "/r/.hydra/overrides.yaml", "/r/submitit")
    assert (p.state, p.emergency, p.emergency_folder(7), p.last_resort_lock(2)) == ("/r/state", "/r/state/emergency.pt", "/r/state/emergency-step7", "/r/state/last-resort-2.lock")
    assert (p.saved, p.saved_step(40), p.saved_index(40)) == ("/r/saved", "/r/saved/step40", "/r/saved/step40/index.json")
    assert (p.final, p.final_model, p.final_state, p.final_index) == ("/r/final", "/r/final/model.pt", "/r/final/state", "/r/final/state/index.json")
    assert (p.tensorboard, p.report) == ("/r/tensorboard", "/r/report.png")


def test_paths_keep_the_root_as_given():
    """A relative run dir stays relative: the paths in messages and summary.json are unchanged."""
    assert RunPaths("outputs/x").summary == os.path.join("outputs/x", "summary.json")


def test_state_file_and_step_folder_names():
    assert (paths.state_file(None), paths.state_file(3)) == ("state.pt", "shard3.pt")
    assert paths.SHARD_FILE.match(paths.state_file(3)).group(1) == "3"
    assert paths.step_folder(12) == "step12" and paths.step_of_folder("step12") == 12
    assert [paths.step_of_folder(n) for n in ("step", "stepx", "step12.tmp", "xstep1", "step12\n")] == [None] * 5


def test_is_run_dir_by_any_marker(tmp_path):
    p = RunPaths(str(tmp_path))
    assert not p.is_run_dir()
    for name in paths.RUN_MARKERS:
        (tmp_path / name).write_text("{}")
        assert p.is_run_dir()
        (tmp_path / name).unlink()
