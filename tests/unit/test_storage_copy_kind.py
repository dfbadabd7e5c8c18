"""The log line of a load names what was loaded (worker/storage.py ``copy_kind``): a requeued
job or ``resume_from`` may start from a periodic copy, the final state or the emergency copy, and
the line said "the emergency copy" for all of them. Paths from ``RunPaths``, as the job names them.
A job resumed from a periodic copy, end to end: tests/e2e/test_reference_cli.py."""

from __future__ import annotations

import pytest

from ckptless_hpc.rundir.paths import RunPaths, state_file
from ckptless_hpc.worker.storage import copy_kind

pytestmark = pytest.mark.timeout(30)

RUN = RunPaths("/runs/2026-12-05/run1")


@pytest.mark.parametrize(
    "path, kind",
    [
        (f"{RUN.saved_step(12)}/{state_file(None)}", "a periodic copy"),
        (f"{RUN.saved_step(12)}/{state_file(3)}", "a periodic copy"),
        (f"{RUN.final_state}/{state_file(None)}", "the final state"),
        (f"{RUN.final_state}/{state_file(0)}", "the final state"),
        (RUN.emergency, "the emergency copy"),
        (f"{RUN.emergency_folder(7)}/{state_file(1)}", "the emergency copy"),
        ("/elsewhere/my-copy/model-state.pt", "a saved copy"),
    ],
)
def test_copy_kind_tells_the_copies_apart_by_their_place(path, kind):
    assert copy_kind(path) == kind
