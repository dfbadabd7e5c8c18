"""No file name of the run directory is spelled outside ``ckptless_hpc/rundir/`` (issue 21): the
names are paths.py's, and everyone else asks ``RunPaths`` (or imports the constant).

An AST scan of the package, so that prose (docstrings, messages with spaces in them) is free
to name the files. It flags:

- a string literal (an f-string's literal parts included) equal to an owned *file* name
  (``"summary.json"``), or a path-like literal (no whitespace, with a ``/``) one of whose parts
  is an owned file or folder name (``"final/state"``, ``f"{d}/events.jsonl"``, ``"logs/*.log"``);
- an owned *folder* name given to ``os.path.join``, ``Path(...)``, ``.joinpath`` or ``/`` on a
  path (``os.path.join(run_dir, "saved")``): a bare ``"state"`` elsewhere is a dict key.
"""

from __future__ import annotations

import ast
import os
from typing import Iterator, List, Tuple

import pytest

import ckptless_hpc
from ckptless_hpc.rundir import paths

pytestmark = pytest.mark.timeout(60)

PACKAGE = os.path.dirname(os.path.abspath(ckptless_hpc.__file__))

FILES = {
    paths.EVENTS, paths.SUMMARY, paths.RESTART, paths.JOB, paths.COORDINATOR_LOG, paths.INDEX, paths.MODEL, paths.EMERGENCY,
    paths.STATE_FILE, paths.REPORT, paths.ZYGOTE_LOG, paths.HYDRA_CONFIG, paths.HYDRA_OVERRIDES, paths.DCP_SOURCE,
}
FOLDERS = {paths.LOGS, paths.HYDRA, paths.SUBMITIT, paths.STATE, paths.SAVED, paths.FINAL, paths.TENSORBOARD}

OWNER = "rundir"  # the one room that spells them

Finding = Tuple[str, int, str]


def _literal_hits(value: str) -> bool:
    if value in FILES:
        return True
    if "/" not in value or any(ch.isspace() for ch in value):
        return False
    return any(part in FILES or part in FOLDERS for part in value.split("/"))


def _is_path_call(node: ast.Call) -> bool:
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr == "joinpath" or (f.attr == "join" and isinstance(f.value, ast.Attribute) and f.value.attr == "path")
    return isinstance(f, ast.Name) and f.id in ("Path", "PurePath")


def _docstrings(tree: ast.AST) -> set:
    """Ids of the string constants that are statements (docstrings, bare strings): prose."""
    return {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}


def scan_source(source: str, where: str = "<source>") -> List[Finding]:
    """(where, line, literal) for every run-dir name spelled in ``source``."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found: List[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose and _literal_hits(node.value):
            found.append((where, node.lineno, node.value))
        args: List[ast.AST] = []
        if isinstance(node, ast.Call) and _is_path_call(node):
            args = list(node.args)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            args = [node.right]
        for a in args:
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in FOLDERS:
                found.append((where, a.lineno, a.value))
    return sorted(set(found), key=lambda f: (f[0], f[1], f[2]))


def _package_files() -> Iterator[Tuple[str, str]]:
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PACKAGE), path


def _room(rel: str) -> str:
    return rel.split(os.sep, 1)[0] if os.sep in rel else ""


def test_no_run_dir_name_is_spelled_outside_rundir():
    found: List[Finding] = []
    for rel, path in _package_files():
        if _room(rel) == OWNER:
            continue
        with open(path, encoding="utf-8") as f:
            found += scan_source(f.read(), rel)
    assert not found, "run-dir names spelled outside ckptless_hpc/rundir/ (HINT: use rundir.paths.RunPaths or its constants):\n" + "\n".join(
        f"  ckptless_hpc/{w}:{line}: {lit!r}" for w, line, lit in found
    )


@pytest.mark.parametrize(
    "source, hits",
    [
        ('p = os.path.join(run_dir, "summary.json")', ["summary.json"]),
        ('p = f"{run_dir}/events.jsonl"', ["/events.jsonl"]),
        ('p = os.path.join(run_dir, "saved", f"step{s}")', ["saved"]),
        ('p = Path(run_dir) / "logs"', ["logs"]),
        ('g = run_dir.glob("submitit/*.err")', ["submitit/*.err"]),
        ('for sub in ("final/state", "state"): pass', ["final/state"]),
        ('NAME = "restart.json"', ["restart.json"]),
    ],
)
def test_the_scan_finds_an_injected_literal(source, hits):
    assert [lit for _, _, lit in scan_source(source)] == hits


@pytest.mark.parametrize(
    "source",
    [
        '"""Reads summary.json and events.jsonl."""',
        'raise ValueError("no events.jsonl in the run dir. HINT: pass hydra.run.dir")',
        'x = {"state": 1}; ok = cmd == "logs"; y = msg["saved"]',
        'p = RunPaths(run_dir).summary',
    ],
)
def test_the_scan_leaves_prose_keys_and_runpaths_alone(source):
    assert scan_source(source) == []
