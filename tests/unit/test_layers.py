"""No import runs back up a layer (DESIGN.md, "Layout (rooms)").

Every import of the package is read from the source (module level and inside functions, so a
lazy import counts as much as a top one) and its room placed in the layer order, top to bottom:

    cli, tools, chaos -> launch -> coordinator, worker -> train, state, control
      -> rundir, tasks, slurm -> config, metrics, faults, progress

An import may go down, or sideways within a layer, never up: a room that needs something of a
room above it gets it passed in (``config.Probes``, ``faults.fire(..., cancel_step)``), or
the thing moves down. The imports that run up today, in rooms whose owners are moving them, are
listed in ``ALLOWED`` with who removes them; an entry that no longer occurs fails the test too,
so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[2] / "ckptless_hpc"

LAYERS: List[Tuple[str, ...]] = [
    ("cli", "__main__", "reference", "tools", "chaos"),
    ("launch",),
    ("coordinator", "worker"),
    ("train", "state", "control"),
    ("rundir", "tasks", "slurm"),
    ("config", "metrics", "faults", "progress", "conf", "__init__"),
]
LEVEL: Dict[str, int] = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}

# (importing module, imported room): upward today, each removed by its room's owner as their branch lands
ALLOWED: Dict[Tuple[str, str], str] = {}


def room_of(module: str) -> Optional[str]:
    """``ckptless_hpc.x.y`` -> ``x`` (the package's ``__init__`` for ``ckptless_hpc`` itself)."""
    parts = module.split(".")
    if parts[0] != "ckptless_hpc":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports(path: Path, package_dir: Path = PACKAGE) -> Iterator[Tuple[str, int]]:
    """(absolute module imported, line) for every import in the file, wherever it stands."""
    me = module_name(path, package_dir)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ckptless_hpc":  # ``from .. import faults``: the names are the rooms
                for alias in node.names:
                    yield f"ckptless_hpc.{alias.name}", node.lineno
            else:
                yield target, node.lineno


def upward_imports(package: Path = PACKAGE) -> List[Tuple[str, str, int]]:
    """(importer, imported, line) of every import that runs up a layer."""
    out = []
    for path in sorted(package.rglob("*.py")):
        me = module_name(path, package)
        mine = room_of(me)
        if path.parent == package and path.stem not in LEVEL:
            raise AssertionError(f"{path.name}: a root module in no layer. HINT: add it to LAYERS in {__file__}")
        for target, line in imports(path, package):
            theirs = room_of(target)
            if theirs is None or mine is None or theirs == mine:
                continue
            if theirs not in LEVEL or mine not in LEVEL:
                raise AssertionError(f"{me} imports {target}: room {theirs if theirs not in LEVEL else mine!r} is in no layer. HINT: add it to LAYERS in {__file__}")
            if LEVEL[theirs] < LEVEL[mine]:
                out.append((me, target, line))
    return out


def test_no_import_runs_up_a_layer():
    found = upward_imports()
    new = [f"{me}:{line} imports {target} (layer {LEVEL[room_of(target)]} above {LEVEL[room_of(me)]})" for me, target, line in found if (me, room_of(target)) not in ALLOWED]
    assert not new, "imports that run up a layer:\n  " + "\n  ".join(new) + "\nHINT: pass what is needed in from above, or move it down (DESIGN.md, Layout)"


def test_the_allowlist_only_holds_imports_that_still_occur():
    still = {(me, room_of(target)) for me, target, _ in upward_imports()}
    gone = [f"{me} -> {room} ({who})" for (me, room), who in ALLOWED.items() if (me, room) not in still]
    assert not gone, "allowed upward imports that no longer occur:\n  " + "\n  ".join(gone) + "\nHINT: remove them from ALLOWED"


def test_an_upward_import_is_caught_lazy_or_not(tmp_path):
    """A copy of two rooms with one import up, inside a function: the scan names it."""
    pkg = tmp_path / "ckptless_hpc"
    (pkg / "launch").mkdir(parents=True)
    for name in ("__init__.py", "config.py", "launch/__init__.py", "launch/local.py"):
        (pkg / name).write_text("")
    (pkg / "config.py").write_text("def f():\n    from .launch.local import x\n")
    (pkg / "launch" / "local.py").write_text("from ..config import Shape\n")  # down: fine
    assert upward_imports(pkg) == [("ckptless_hpc.config", "ckptless_hpc.launch.local", 2)]
