from __future__ import annotations

import pytest

from ckptless_hpc.faults import Fault, due

pytestmark = pytest.mark.timeout(10)

FAULTS = [Fault(0, "kill_worker", 5, rank=1), Fault(1, "kill_node", 9, node=1), Fault(2, "hang", 9, rank=0)]


def test_due_matches_rank_and_step_once():
    assert due(FAULTS, [], rank=1, workers_per_node=2, step=5).index == 0
    assert due(FAULTS, [0], rank=1, workers_per_node=2, step=5) is None  # a replacement never re-fires it
    assert due(FAULTS, [], rank=1, workers_per_node=2, step=6) is None


def test_node_fault_fires_on_the_first_rank_of_the_slot():
    assert due(FAULTS, [], rank=2, workers_per_node=2, step=9).index == 1
    assert due(FAULTS, [], rank=3, workers_per_node=2, step=9) is None
    assert due(FAULTS, [], rank=0, workers_per_node=2, step=9).index == 2


def test_a_damaged_transfer_strikes_the_state_served_or_only_its_optimizer_part():
    any_part, optimizer = Fault(0, "corrupt_transfer", 3, rank=0), Fault(1, "truncate_transfer", 3, rank=0, at="optimizer")
    assert due([any_part], [], rank=0, workers_per_node=1, step=4, at="send").index == 0
    assert due([any_part], [], rank=0, workers_per_node=1, step=4, at="optimizer") is None
    assert due([optimizer], [], rank=0, workers_per_node=1, step=4, at="send") is None  # the parameters go out undamaged
    assert due([optimizer], [], rank=0, workers_per_node=1, step=4, at="optimizer").index == 1
    assert due([optimizer], [], rank=0, workers_per_node=1, step=2, at="optimizer") is None
