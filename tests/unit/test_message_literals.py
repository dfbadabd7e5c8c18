"""No message is built as a dict literal outside control/messages.py: every ``{"type": ...}``
(or ``dict(type=...)``) in the package is a seam the message classes were made to declare."""

import ast
from pathlib import Path

import pytest

import ckptless_hpc

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(ckptless_hpc.__file__).parent
OWNER = "control/messages.py"


def message_literals(source: str):
    """Line numbers of the dict literals with a constant ``"type"`` key, and of ``dict(type=...)`` calls."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "type" for k in node.keys):
            yield node.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and any(k.arg == "type" for k in node.keywords):
            yield node.lineno


def test_no_message_literal_outside_control_messages():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == OWNER:
            continue
        found += [f"{rel}:{line}" for line in message_literals(path.read_text(encoding="utf-8"))]
    assert not found, f"messages built as dict literals: {found}. HINT: build them with a class of ckptless_hpc/{OWNER} and its encode()"


def test_the_scan_sees_literals_and_only_them():
    src = 'a = {"type": "hb", "gen": 1}\nb = dict(type="stop")\nc = {"kind": "x"}\nd = {**e}\nlog(type=f)\n'
    assert list(message_literals(src)) == [1, 2]
