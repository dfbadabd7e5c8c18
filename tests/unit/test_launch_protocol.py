"""Every launcher implements every member of ``launch.base.Launcher``, with its arguments.

The coordinator calls its launcher's members directly (no ``getattr`` with a default): a
launcher that lacks one, or takes other arguments, fails here rather than in the middle of a
recovery. The stand-ins of the tests and benchmarks are held to the same Protocol, so that a
test's coordinator runs the code a job's does.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest

from ckptless_hpc.launch import base
from ckptless_hpc.launch.local import LocalLauncher
from ckptless_hpc.launch.slurm import SlurmLauncher

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # bench/, from any working directory

from coordlib import NoLauncher  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _stand_ins():
    from bench.b7_coord import SimLauncher
    from test_scheduler_commands import OrderLauncher

    return [SimLauncher, OrderLauncher]


LAUNCHERS = [LocalLauncher, SlurmLauncher, NoLauncher]


def _parameters(fn):
    """(name, kind, has a default) of each parameter but ``self``: what a caller relies on."""
    ps = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in ps]


def mismatches(cls) -> list:
    """What ``cls`` lacks or spells differently from the Protocol, one line each."""
    out, absent = [], object()
    for name, want in base.members().items():
        have = inspect.getattr_static(cls, name, absent)
        if have is absent or (callable(want) and have is None):
            out.append(f"{cls.__name__}.{name}: missing")
        elif not callable(want):
            continue  # an attribute: its presence on the class is what counts
        elif not callable(have):
            out.append(f"{cls.__name__}.{name}: not a method")
        elif _parameters(have) != _parameters(want):
            out.append(f"{cls.__name__}.{name}{inspect.signature(have)}: the Protocol's is {name}{inspect.signature(want)}")
        elif inspect.iscoroutinefunction(have) != inspect.iscoroutinefunction(want):
            out.append(f"{cls.__name__}.{name}: {'async' if inspect.iscoroutinefunction(want) else 'plain'} in the Protocol")
    return out


def test_the_protocol_declares_every_member_the_coordinator_calls():
    names = set(base.members())
    assert names == {
        "batch_node", "node_is_one_step", "measures_identity", "start_node", "initial_nodes", "free_node", "register", "kill_worker",
        "exclude_node", "drained_nodes", "hold_commands", "release_commands", "requeue", "log_path", "launched_identity", "live_identity", "shutdown",
    }
    for name, fn in vars(base.Launcher).items():
        if callable(fn) and not name.startswith("_"):
            assert (fn.__doc__ or "").strip(), f"Launcher.{name} has no docstring"


@pytest.mark.parametrize("cls", LAUNCHERS, ids=lambda c: c.__name__)
def test_each_launcher_implements_the_protocol(cls):
    assert mismatches(cls) == []
    assert base.Launcher not in cls.__mro__  # implements every member, inherits no default


def test_the_stand_ins_implement_the_protocol():
    for cls in _stand_ins():
        assert mismatches(cls) == [], cls


def test_a_missing_or_misspelled_member_is_named():
    class Partial(NoLauncher):
        pass

    Partial.free_node = None  # type: ignore[assignment]  # shadows the inherited one
    Partial.kill_worker = lambda self, wid, now: None  # type: ignore[assignment]
    got = mismatches(Partial)
    assert any(line.startswith("Partial.free_node: missing") for line in got), got
    assert any(line.startswith("Partial.kill_worker(") for line in got), got
