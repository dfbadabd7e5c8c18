"""The examples in examples/ run as real jobs through the CLI, with a worker killed mid-run,
and end bitwise equal to their fault-free runs (the oracle).

The Hugging Face example needs ``transformers`` (the ``examples`` extra). Without it the test
skips with the reason, unless CKPTLESS_REQUIRE_EXAMPLES=1, where it fails: CI sets that.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from ckpt_testlib import REPO, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SEARCH = f"hydra.searchpath=[file://{REPO}/examples/conf]"
FAST_HB = ("cluster.heartbeat_interval_s=0.25", "cluster.heartbeat_timeout_s=1.5")
KILL = ("fault=kill_worker", "fault.rank=1", "fault.step=5")


def _require_transformers() -> None:
    if importlib.util.find_spec("transformers") is not None:
        return
    why = "transformers is not installed. HINT: pip install -e '.[examples]'"
    if os.environ.get("CKPTLESS_REQUIRE_EXAMPLES") == "1":
        pytest.fail(f"CKPTLESS_REQUIRE_EXAMPLES=1 but {why}")
    pytest.skip(f"{why} (set CKPTLESS_REQUIRE_EXAMPLES=1 to make this a failure)")


def _assert_recovered_equal(res, baseline_sha: str) -> None:
    assert res.rc == 0, res.out
    s = res.summary
    assert s["status"] == "completed" and s["steps_completed"] == s["steps_requested"]
    assert len(s["recoveries"]) == 1 and s["recoveries"][0]["survivors_restarted"] == 0
    assert s["final_state_sha256"] == baseline_sha


def test_hf_causal_lm_survives_a_killed_worker(job, baseline):
    """A transformers GPT-2 (random init, dropout on) through the task config group."""
    _require_transformers()
    cfg = (SEARCH, "task=hf_causal_lm", "train.steps=10", *FAST_HB)
    res = job(*cfg, *KILL)
    _assert_recovered_equal(res, baseline(*cfg))
    assert any("HFCausalLMTask(gpt2" in line for line in (res.run_dir / "logs" / "local0.0.log").read_text().splitlines())


def test_plain_loop_survives_a_killed_worker(job, baseline):
    """The adapted PyTorch loop, named by _target_ alone (no YAML): ~task +task._target_=..."""
    cfg = ("~task", "+task._target_=examples.plain_loop.RegressionTask", "+task.batch_size=16", "optim.lr=0.05", "train.steps=30", *FAST_HB)
    res = job(*cfg, *KILL)
    _assert_recovered_equal(res, baseline(*cfg))


def documented_commands() -> list:
    """(where, command) of every ``python -m ckptless_hpc ...`` command an example documents: in
    its module docstring and in docs/tasks.md's shell blocks (those naming examples.*), with the
    lines a trailing backslash continues."""
    found = []
    sources = [(f"examples/{p.name}", ast.get_docstring(ast.parse(p.read_text())) or "") for p in sorted((REPO / "examples").glob("*.py"))]
    docs = (REPO / "docs" / "tasks.md").read_text()
    sources.append(("docs/tasks.md", "\n".join(re.findall(r"```bash\n(.*?)```", docs, re.S))))
    for where, text in sources:
        for cmd in re.findall(r"python -m ckptless_hpc (?:[^\n]*\\\n)*[^\n]*", text):
            cmd = re.sub(r"\s*#.*$", "", re.sub(r"\\\n\s*", " ", cmd))
            if "examples" in cmd:
                found.append((where, cmd))
    return found


def test_every_documented_example_command_passes_a_dry_run(tmp_path):
    """Each example's documented command, as written (run from the repository root, as the
    docstrings say), passes ``dry_run=true``: the class imports and takes the arguments given
    (``task._target_=...`` alone, the lm task's arguments passed on, exits 2)."""
    commands = documented_commands()
    assert {w for w, _ in commands} >= {"examples/hf_causal_lm.py", "examples/plain_loop.py", "examples/ema.py", "docs/tasks.md"}, commands
    for i, (where, cmd) in enumerate(commands):
        line = f"{cmd} dry_run=true hydra.run.dir={tmp_path / str(i)}".replace("python -m ckptless_hpc", f"{sys.executable} -m ckptless_hpc", 1)
        p = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert p.returncode == 0 and "configuration valid" in p.stdout, (where, cmd, p.stdout[-2000:], p.stderr[-2000:])


def test_plain_loop_batches_are_an_epoch_permutation_split_over_ranks():
    """batch() is a pure function of (step, rank, world): ranks get disjoint slices, and the
    steps of one epoch see every sample exactly once."""
    from examples.plain_loop import RegressionTask

    task = RegressionTask(n_samples=64, batch_size=4)
    world, g = 2, torch.Generator()
    seen = []
    for step in range(64 // (4 * world)):
        for rank in range(world):
            x, _ = task.batch(step, rank, world, g)
            seen += [int(torch.nonzero((task.x == row).all(dim=1))[0]) for row in x]
    assert sorted(seen) == list(range(64))
    again, _ = RegressionTask(n_samples=64, batch_size=4).batch(3, 1, world, torch.Generator().manual_seed(99))
    first, _ = task.batch(3, 1, world, g)
    assert torch.equal(again, first)  # the generator's state does not matter to this task


def test_token_file_lm_reads_a_memory_mapped_file_in_data_workers_and_survives(job, baseline, tmp_path):
    """A map-style dataset over a memory-mapped token file, in a DataLoader with 2 worker
    processes per rank: a replacement starts reading at the committed step (the oracle)."""
    from examples.token_file_lm import TokenFile, write_tokens

    path = tmp_path / "tokens.bin"
    n = write_tokens(str(path))
    ds = TokenFile(str(path), seq_len=64)
    assert len(ds) == (n - 1) // 64 and ds[3].shape == (65,) and ds[3][0] == ds[2][64]
    cfg = (SEARCH, "task=token_file_lm", f"task.path={path}", "train.data_workers=2", "train.steps=20", *FAST_HB)
    res = job(*cfg, *KILL)
    _assert_recovered_equal(res, baseline(*cfg))
    # the same bytes as batches made in the training thread
    assert baseline(*cfg) == baseline(*(o for o in cfg if o != "train.data_workers=2"))


EMA = (SEARCH, "task=ema", "train.steps=16", "train.eval_every=4", "train.eval_batches=4", *FAST_HB)


@pytest.fixture(scope="module")
def ema_baseline(tmp_path_factory):
    """The EMA example's fault-free run (its hash and its evaluations)."""
    res = run_job(tmp_path_factory.mktemp("ema"), *EMA, "fault=none")
    assert res.rc == 0, res.out
    return res


def _evals(res) -> dict:
    """step -> metrics of the evaluations (a redone one must give the same values: the last is kept)."""
    return {e["step"]: e["metrics"] for e in res.of("eval")}


def test_ema_example_survives_a_killed_worker_with_the_same_evaluations(job, ema_baseline):
    """The EMA weights live in the task's state_dict(): carried to the replacement and hashed;
    the evaluations (model and EMA weights) equal the fault-free run's, bitwise."""
    res = job(*EMA, *KILL)
    _assert_recovered_equal(res, ema_baseline.summary["final_state_sha256"])
    assert sorted(_evals(ema_baseline)) == [4, 8, 12, 16]
    assert _evals(res) == _evals(ema_baseline)
    assert set(_evals(res)[16]) == {"loss", "accuracy", "ema_loss", "ema_accuracy"}
    assert res.summary["eval"] == ema_baseline.summary["eval"] == {"step": 16, "metrics": _evals(ema_baseline)[16]}
    assert res.summary["final_metrics"] == ema_baseline.summary["final_metrics"] and "accuracy" in res.summary["final_metrics"]
    assert all("accuracy" in e["metrics"] for e in res.of("step"))
    assert "eval at step 16: accuracy" in res.out and "eval         step 16: accuracy" in res.out  # the console line, the summary
    # the last evaluation is a plain no_grad evaluation of the weights the job left (final/): model.pt and the task's EMA state
    from examples.ema import EMATask
    from ckptless_hpc.state import emergency
    from ckptless_hpc.train.evaluation import ValSource

    task = EMATask(decay=0.9)
    model = task.build_model()
    model.load_state_dict(torch.load(res.summary["final"]["model"]["path"], weights_only=True))
    entries, meta = emergency.read(os.path.join(res.summary["final"]["state"]["path"], "state.pt"))
    task.load_state_dict({**meta["task_scalars"], **{n[len("task."):]: t for n, t in entries if n.startswith("task.")}})
    model.eval()
    with torch.no_grad():
        plain = [task.evaluate(model, ValSource(task, 0).batch(i, 0, 1)) for i in range(4)]
    for name, value in res.summary["eval"]["metrics"].items():
        want = sum(float(m[name]) for m in plain) / 4
        assert abs(value - want) <= 1e-6 * max(1.0, abs(want)), (name, value, want)


def test_a_worker_killed_during_an_evaluation_is_recovered_and_the_evaluation_redone(job, ema_baseline):
    res = job(*EMA, "fault=kill_worker", "fault.rank=1", "fault.step=8", "fault.at=eval")
    _assert_recovered_equal(res, ema_baseline.summary["final_state_sha256"])
    assert [e["step"] for e in res.of("fault_injected")] == [8]
    assert res.summary["recoveries"][0]["target_step"] == 8
    assert [e["gen"] for e in res.of("eval") if e["step"] == 8] == [1]  # gen 0's never completed; gen 1 redid it
    assert _evals(res) == _evals(ema_baseline)


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_llama_parallel_survives_a_killed_rank(layout, job, baseline):
    """examples/llama.py's LlamaParallelTask, the README's commands: tensor parallel (2 x 2) and
    pipeline parallel (2 stages x 2, 1F1B over 4 micro-batches), a rank of replica 1 killed."""
    mode = ("parallel=tp", "parallel.tp=2") if layout == "tp" else ("parallel=pp", "parallel.pp=2", "parallel.pp_schedule=1f1b", "train.grad_accum=4")
    cfg = ("~task", "+task._target_=examples.llama.LlamaParallelTask", *mode, "cluster.nodes=2", "cluster.workers_per_node=2", "train.steps=10", *FAST_HB)
    res = job(*cfg, "fault=kill_worker", "fault.rank=3", "fault.step=5")
    _assert_recovered_equal(res, baseline(*cfg))
