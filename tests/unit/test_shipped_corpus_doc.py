"""docs/tasks.md ("The shipped corpus") shows how a task of yours reads the corpus shipped in the
package: the snippet there runs as written, and gives what it says."""

from __future__ import annotations

import re

import pytest
import torch

from ckpt_testlib import REPO

pytestmark = pytest.mark.timeout(60)


def test_the_documented_corpus_snippet_runs():
    text = (REPO / "docs" / "tasks.md").read_text()
    section = text[text.index("**The shipped corpus.**") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/tasks.md", "exec"), scope)
    data, train, val, window = scope["data"], scope["train"], scope["val"], scope["window"]
    assert data.dtype == torch.uint8 and len(data) > 400_000
    assert len(train) + len(val) == len(data) and abs(len(val) / len(data) - 0.1) < 1e-3
    assert window.dtype == torch.long and window.shape == (65,) and int(window.max()) < 256
