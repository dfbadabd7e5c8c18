"""The fixed-order reduction (train/fixed.py) on real gloo groups (threads in one process, one
group per layout): for every assignment of the virtual ranks to processes, the result is bitwise
the tree sum computed in one process, and equals torch's all-reduce within float tolerance; gloo's
all-reduce itself is not bitwise across process counts (which is why the mode exists)."""

from __future__ import annotations

import random
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ckptless_hpc.train.comm import Communicator
from ckptless_hpc.train.fixed import FixedReduce, combine, cover, holders_of, split, tree_sum

pytestmark = pytest.mark.timeout(300)


def _leaf(v: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + v)
    return torch.randn(n, generator=g, dtype=dtype) * (10.0 ** (v % 3 - 1))  # mixed magnitudes: the order shows


def _partitions(items):
    """Every set partition of ``items`` (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1 :]
        yield [[first]] + part


def _run(store, case: int, holders, tensors_of, with_allreduce: bool = False):
    """Each process's reduced tensors (and its all-reduce of its local sums): threads, one gloo group."""
    size = len(holders)
    prefixed = dist.PrefixStore(f"case{case}", store)
    out, errors = [None] * size, []

    def proc(r: int) -> None:
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            opts._timeout = timedelta(seconds=60)
            comm = Communicator(dist.ProcessGroupGloo(prefixed, r, size, opts), 0, r, size, holders=holders)
            plan = FixedReduce(sum(len(h) for h in holders), comm.holders, r)
            leaves = {v: tensors_of(v) for v in comm.vranks}
            got = plan.reduce(comm, plan.partials(leaves), lambda fs: [f.wait() for f in fs])
            ar = None
            if with_allreduce:
                ar = leaves[comm.vranks[0]][0].clone()  # the usual path: a local sum, then gloo's all-reduce
                for v in comm.vranks[1:]:
                    ar += leaves[v][0]
                comm.allreduce(ar).wait()
            out[r] = (got, ar)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=proc, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_the_tree_and_its_cover():
    assert [split(0, w) for w in (2, 3, 4, 5, 8, 9)] == [1, 2, 2, 4, 4, 8]
    assert cover(0, 5, frozenset(range(5))) == [(0, 5)]
    assert cover(0, 5, frozenset({0, 1, 4})) == [(0, 2), (4, 5)]
    assert cover(0, 5, frozenset({1, 2})) == [(1, 2), (2, 3)]
    # the sum over (0, 5) is ((0 + 1) + (2 + 3)) + 4, whoever holds which part
    x = {v: torch.tensor([float(v) + 0.1]) for v in range(5)}
    assert torch.equal(tree_sum(0, 5, x.__getitem__), ((x[0] + x[1]) + (x[2] + x[3])) + x[4])
    assert torch.equal(combine(0, 5, {(0, 2): x[0] + x[1], (2, 3): x[2], (3, 4): x[3], (4, 5): x[4]}), tree_sum(0, 5, x.__getitem__))
    with pytest.raises(ValueError, match=r"exactly once"):
        holders_of(3, [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"exactly once"):
        holders_of(3, [[0, 1], []])


def test_every_assignment_gives_the_one_process_tree_sum_bitwise():
    """All 52 set partitions of 5 virtual ranks, the processes in a shuffled order, on two
    tensors (float32 of an odd length that no process count divides, and a float64 of 3, the
    loss vector's shape): every process of every layout gets the tree sum, bitwise."""
    vworld, n = 5, 1001
    tensors = {v: [_leaf(v, n, torch.float32), _leaf(v, 3, torch.float64)] for v in range(vworld)}
    want = [tree_sum(0, vworld, lambda v, i=i: tensors[v][i]) for i in range(2)]
    store, rng = dist.HashStore(), random.Random(0)
    layouts = list(_partitions(list(range(vworld))))
    assert len(layouts) == 52
    for case, layout in enumerate(layouts):
        rng.shuffle(layout)
        for r, (got, _) in enumerate(_run(store, case, layout, tensors.__getitem__)):
            for i in range(2):
                assert torch.equal(got[i], want[i]), f"layout {layout}, process {r}, tensor {i}: not the tree sum"


def test_equal_to_all_reduce_within_tolerance_and_all_reduce_is_not_bitwise():
    vworld, n = 4, 100_003
    tensors = {v: [_leaf(v, n, torch.float32)] for v in range(vworld)}
    want = tree_sum(0, vworld, lambda v: tensors[v][0])
    store = dist.HashStore()
    all_reduced = []
    for case, layout in enumerate(([[0], [1], [2], [3]], [[0, 1], [2], [3]], [[0, 1, 2], [3]])):
        for got, ar in _run(store, case, layout, tensors.__getitem__, with_allreduce=True):
            assert torch.equal(got[0], want)
            assert torch.allclose(ar, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            all_reduced.append(ar)
    assert any(not torch.equal(a, all_reduced[0]) for a in all_reduced), "gloo's all-reduce was bitwise across layouts: the case shows nothing"


def test_a_shrunk_generation_deals_the_lost_ranks_over_the_live_processes():
    from ckptless_hpc.rundir.numbering import shrunk

    assert shrunk(3, []) == ([0, 1, 2], [[0], [1], [2]])
    assert shrunk(3, [2]) == ([0, 1], [[0, 2], [1]])
    assert shrunk(3, [0]) == ([1, 2], [[1, 0], [2]])  # rank 0 goes to process 0: it then reports for the job
    assert shrunk(6, [4, 5]) == ([0, 1, 2, 3], [[0, 4], [1], [2, 5], [3]])  # spread, not piled on the first
    for world, lost in ((6, [0, 1]), (8, [1, 2, 3, 4, 5]), (5, [4])):
        live, holders = shrunk(world, lost)
        assert sorted(v for h in holders for v in h) == list(range(world)) and [h[0] for h in holders] == live
        assert max(map(len, holders)) - min(map(len, holders)) <= 1 and 0 in holders[0]
    with pytest.raises(ValueError, match="every rank"):
        shrunk(2, [0, 1])
