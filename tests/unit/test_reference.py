"""``python -m ckptless_hpc.reference``: the plain loop made public, and its command.

Bad input exits 2 with the field and a HINT before torch is imported (a subprocess, as a user
runs it); the comparison is proven on a model file the reference itself wrote (exit 0, every
tensor equal) and on a copy with one tensor moved by 1e-3 of its magnitude (exit 1, that tensor
named first). The real job against the reference: tests/e2e/test_reference_cli.py.
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from ckpt_testlib import REPO
from ckptless_hpc import reference
from ckptless_hpc.rundir.paths import RunPaths

pytestmark = pytest.mark.timeout(120)

TINY = ("task=mlp", "task.hidden=8", "train.steps=2")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptless_hpc.reference", *args], capture_output=True, text=True, timeout=90, cwd=REPO)


@pytest.mark.parametrize(
    "args, wanted",
    [
        (("task=mlp", "train.stepz=3", "--out", os.devnull), ("train.stepz", "HINT")),  # an unknown key
        (("task=nope", "--out", os.devnull), ("task", "nope", "HINT")),  # an unknown config group option
        (("task=mlp", "train.steps=0", "--out", os.devnull), ("train.steps", "HINT")),  # the job's own validation
        (("~task", "+task._target_=nowhere_pkg.tasks.MyTask", "--out", os.devnull), ("nowhere_pkg", "cannot be imported", "HINT", "PYTHONPATH")),
        (("~task", "+task._target_=ckptless_hpc.tasks.mlp.MLPTask", "+task.hiden=3", "--out", os.devnull), ("task.hiden=3", "HINT: did you mean task.hidden?")),
        (("task=mlp", "--compare", "/nonexistent/run"), ("--compare /nonexistent/run", "no such file or directory", "HINT")),
        (("task=mlp",), ("nothing to do", "HINT")),
        (("task=mlp", "--out", os.devnull, "--tol", "-1"), ("--tol -1", "HINT")),
        (("task=mlp", "--out", os.devnull, "--tol", "nan"), ("--tol nan", "HINT")),
        (("task=mlp", "--out", os.devnull, "--bogus"), ("--bogus", "HINT")),
    ],
)
def test_bad_input_exits_2_with_the_field_and_a_hint(args, wanted):
    p = _cli(*args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    for w in wanted:
        assert w in p.stderr, (w, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr


def test_a_run_dir_without_a_final_model_is_bad_input(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    assert reference.main([*TINY, "--compare", str(tmp_path)], out=out, err=err) == 2
    assert RunPaths(str(tmp_path)).final_model in err.getvalue() and "train.save_final" in err.getvalue() and "HINT" in err.getvalue()


@pytest.fixture
def threads():
    """main() sets torch's thread count as the job's workers do: give this process its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _run_dir(tmp_path, name: str, state: dict, overrides=TINY):
    """A run directory as a job leaves it: final/model.pt and the composed config in .hydra/."""
    paths = RunPaths(str(tmp_path / name))
    for f in (paths.final_model, paths.hydra_config):
        os.makedirs(os.path.dirname(f), exist_ok=True)
    torch.save(state, paths.final_model)
    OmegaConf.save(reference.compose_config(overrides), paths.hydra_config)
    return paths.root


def test_the_reference_against_its_own_model_and_a_perturbed_copy(tmp_path, threads):
    out, err = io.StringIO(), io.StringIO()
    written = tmp_path / "ref.pt"
    assert reference.main([*TINY, "--out", str(written)], out=out, err=err) == 0, err.getvalue()
    state = torch.load(written, weights_only=True)
    same = _run_dir(tmp_path, "same", state)
    out = io.StringIO()
    assert reference.main([*TINY, "--compare", same], out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    assert "within the tolerance" in text and "every tensor equal" in text and "note:" not in text, text
    assert all(k in text for k in state), text

    name = sorted(state)[1]
    moved = dict(state, **{name: state[name] * (1 + 1e-3)})
    worse = _run_dir(tmp_path, "worse", moved)
    out = io.StringIO()
    assert reference.main([*TINY, "--compare", worse, "--tol", "1e-5"], out=out, err=err) == 1
    lines = out.getvalue().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("tensor"))
    assert lines[head + 1].split()[0] == name, lines  # the worst first
    assert float(lines[head + 1].split()[1]) == pytest.approx(1e-3, rel=1e-2)
    assert f"beyond the tolerance: 1 of {len(state)} tensor(s)" in lines[-1] and name in lines[-1] and "HINT" in lines[-1], lines[-1]
    out = io.StringIO()
    assert reference.main([*TINY, "--compare", worse, "--tol", "2e-3"], out=out, err=err) == 0, out.getvalue()


def test_without_overrides_the_run_s_own_config_is_trained_and_other_overrides_are_noted(tmp_path, threads):
    """No overrides: RUN_DIR/.hydra/config.yaml (what the job composed); overrides that train
    something else than the run's config are named in a note (and the comparison fails)."""
    out, err = io.StringIO(), io.StringIO()
    written = tmp_path / "ref.pt"
    assert reference.main([*TINY, "--out", str(written)], out=out, err=err) == 0
    run = _run_dir(tmp_path, "run", torch.load(written, weights_only=True))
    out = io.StringIO()
    assert reference.main(["--compare", run], out=out, err=err) == 0, (out.getvalue(), err.getvalue())
    assert f"config: the run's own ({RunPaths(run).hydra_config})" in out.getvalue()
    out = io.StringIO()
    assert reference.main([*TINY[:-1], "train.steps=3", "--compare", run], out=out, err=err) == 1
    assert "note: the run was trained with another config: train.steps (run: 2, here: 3)" in out.getvalue(), out.getvalue()


def test_differences_name_every_key_of_either_side():
    want = {"w": torch.tensor([1.0, -2.0]), "n": torch.tensor([3, 4]), "c": torch.tensor([1 + 1j]), "e": torch.zeros(0), "gone": torch.ones(1)}
    got = {"w": torch.tensor([1.0, -2.002]), "n": torch.tensor([3, 5]), "c": torch.tensor([1 + 1j]), "e": torch.zeros(0), "extra": torch.ones(1)}
    d = reference.differences(got, want)
    assert d["w"] == pytest.approx(1e-3, rel=1e-3) and d["n"] == 1.0 and d["c"] == 0.0 and d["e"] == 0.0
    assert math.isinf(d["gone"]) and math.isinf(d["extra"])
    assert math.isinf(reference.differences({"w": torch.ones(3)}, {"w": torch.ones(2)})["w"])
    rows = reference.table(d, got, want)
    assert [r.split()[0] for r in rows] == ["tensor", "extra", "gone", "n", "w", "c", "e"]
    assert "not in the reference" in rows[1] and "missing in the run" in rows[2]
    code, line = reference.verdict(d, 1e-5)
    assert code == 1 and "4 of 6" in line
    assert reference.verdict({"a": 0.0, "b": 2e-6}, 1e-5) == (0, "within the tolerance: the largest relative difference is 2e-06 (b) <= 1e-05")
    assert reference.verdict({"a": float("nan")}, 1e-5)[0] == 1
    with pytest.raises(AssertionError):
        reference.max_differences(got, want)  # the tests' form: the same keys, or it fails


def test_the_tests_plain_loop_is_the_public_reference():
    import plain_loop

    assert plain_loop.train is reference.train and plain_loop.max_differences is reference.max_differences


def test_a_bad_override_is_refused_before_torch_is_imported():
    code = (
        "import sys; from ckptless_hpc import reference; "
        "rc = reference.main(['task=mlp', 'train.stepz=1', '--out', 'x.pt']); "
        "print(rc, 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.stdout.split() == ["2", "False"], (p.stdout, p.stderr)


def test_a_model_file_that_is_no_state_dict_is_bad_input(tmp_path):
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"not a torch file")
    p = _cli(*TINY, "--compare", str(bad))
    assert p.returncode == 2 and "not a readable state_dict file" in p.stderr and "HINT" in p.stderr, p.stderr


def test_a_training_the_job_would_stop_exits_3_not_1():
    """A non-finite step under train.on_nonfinite=stop (the job ends with exit 7), or the task's
    own code raising: exit 3 with the reason, never 1 (which says "beyond the tolerance")."""
    tasks = str(REPO / "tests" / "e2e" / "tasks_for_tests")
    nan = ("~task", "+task._target_=engine_tasks.NanAtStepMLP", "+task.nan_steps=[1]", "train.steps=3")
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc.reference", *nan, "--out", os.devnull], capture_output=True, text=True, timeout=90, cwd=REPO, env={**os.environ, "PYTHONPATH": tasks})
    assert p.returncode == 3 and "step 1" in p.stderr and "train.on_nonfinite=stop" in p.stderr, p.stderr
    raises = ("~task", "+task._target_=bad_tasks.RaisesAtStep", "train.steps=5")
    p = subprocess.run([sys.executable, "-m", "ckptless_hpc.reference", *raises, "--out", os.devnull], capture_output=True, text=True, timeout=90, cwd=REPO, env={**os.environ, "PYTHONPATH": tasks})
    assert p.returncode == 3 and "the task's own bug at step 3" in p.stderr and "Traceback" in p.stderr, p.stderr


def test_skipped_steps_and_the_hook_are_what_the_engine_does():
    """The reference against the real engine on two ranks (tests/unit/test_engine_two_ranks.py's
    harness): a NaN step dropped under on_nonfinite=skip (buffers kept, the scheduler moving on),
    and on_step_end's state (EMA weights) after every committed update."""
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    import test_engine_two_ranks as H
    from examples.ema import EMATask

    cfg = H._cfg("ddp", on_nonfinite="skip", max_skipped_fraction=0.5)
    engines, results = H._train_two_ranks(lambda: H.T.NanAtStepMLP(nan_steps=(2,)), cfg)
    assert [r.skipped for r in results[0]].count("nonfinite") == 1
    want = reference.train(H.T.NanAtStepMLP(nan_steps=(2,)), cfg).state_dict()
    assert max(reference.max_differences(engines[0].model.state_dict(), want).values()) <= 1e-5

    cfg = H._cfg("ddp")
    engines, _ = H._train_two_ranks(lambda: EMATask(decay=0.5), cfg)
    task = EMATask(decay=0.5)
    reference.train(task, cfg)
    ema = {k: v for k, v in engines[0].task.state_dict().items()}
    assert max(reference.max_differences(ema, task.state_dict()).values()) <= 1e-5
    fresh = EMATask(decay=0.5)
    torch.manual_seed(int(cfg.train.seed))
    fresh.build_model()  # the initial weights, the EMA's start
    assert ema.keys() == fresh.state_dict().keys()
    assert not any(torch.equal(ema[k], v) for k, v in fresh.state_dict().items())  # the hook ran: the EMA weights moved from the initial ones
