"""docs/claims.md names the tests that prove each claim: every one it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def test_every_test_the_claims_page_names_exists():
    named = NAMED.findall((REPO / "docs" / "claims.md").read_text())
    assert len(named) >= 40, f"only {len(named)} tests named: the page's format changed?"
    missing = []
    for path, name in named:
        source = REPO / path
        if not source.is_file() or (name and not re.search(rf"^def {name}\(", source.read_text(), re.M)):
            missing.append(f"{path}::{name}" if name else path)
    assert not missing, f"docs/claims.md names tests that do not exist: {missing}"
