"""restart.json (rundir/restart.py): what a requeued job starts from, pure data in and out."""

from __future__ import annotations

import json

import pytest

from ckptless_hpc.rundir.restart import FILE, Restart, shard_copy, write
from ckptless_hpc.coordinator.shell import Coordinator
from coordlib import NoLauncher, cfg

pytestmark = pytest.mark.timeout(60)

SAVED = {"path": "/run/state/emergency.pt", "step": 12, "sha256": "ab" * 32, "bytes": 10, "written": True}


def test_the_file_holds_the_copy_the_excluded_nodes_and_the_faults_fired_sorted(tmp_path):
    path = write(str(tmp_path), Restart.of(SAVED, {"n3", "n1"}, {2, 0}, "batch0"))
    assert path == str(tmp_path / FILE) and [p.name for p in tmp_path.iterdir()] == [FILE]  # no temporary file left
    text = (tmp_path / FILE).read_text()
    assert text == json.dumps({"saved": SAVED, "excluded_nodes": ["n1", "n3"], "faults_done": [0, 2], "batch_node": "batch0"}, indent=2) + "\n"
    assert Restart.from_json(json.loads(text)) == Restart.of(SAVED, ["n1", "n3"], [0, 2], "batch0")


def test_a_file_without_some_keys_reads_as_empty():
    assert Restart.from_json({}) == Restart()
    r = Restart.from_json({"saved": SAVED})
    assert r.saved == SAVED and r.excluded_nodes == frozenset() and r.faults_done == frozenset() and r.batch_node is None


def test_a_rewrite_replaces_the_file(tmp_path):
    write(str(tmp_path), Restart.of(None, [], [], None))
    write(str(tmp_path), Restart.of(SAVED, ["n1"], [], None))
    assert json.loads((tmp_path / FILE).read_text())["saved"] == SAVED


def test_each_rank_of_a_sharded_job_loads_its_own_shard():
    load = {"path": "/run/state/emergency-step4", "step": 4, "sha256": "cd", "shards": {"0": {"path": "/s0.pt", "sha256": "x0"}, "1": {"path": "/s1.pt", "sha256": "x1"}}}
    assert shard_copy(load, 1) == {"path": "/s1.pt", "sha256": "x1", "step": 4, "shard": 1}
    assert shard_copy(load, 2) is None  # no such shard in the copy: nothing to load
    assert shard_copy(load, None) is load  # a replicated rank of the job loads the whole entry
    assert shard_copy(SAVED, 0) is SAVED and shard_copy(None, 0) is None


def test_the_coordinator_writes_what_it_restores(tmp_path):
    c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2"), str(tmp_path), NoLauncher(), "s" * 64, "job-test")
    c.restore({"saved": SAVED, "excluded_nodes": ["n9"], "faults_done": [1]})
    assert c.resume == SAVED and c.bad_nodes == {"n9"} and c.job.faults_done == {1}
    c.job.faults_done.add(3)
    c._persist()
    c.events.close()
    assert json.loads((tmp_path / FILE).read_text()) == {"saved": SAVED, "excluded_nodes": ["n9"], "faults_done": [1, 3], "batch_node": None}


def test_a_ranks_last_resort_keeps_what_the_coordinator_wrote_and_excludes_its_node(tmp_path):
    from ckptless_hpc.rundir.restart import after_last_resort, read_or_empty

    write(str(tmp_path), Restart.of(None, {"n3"}, {1}, "batch0"))
    mine = dict(SAVED, step=20)
    state = after_last_resort(read_or_empty(str(tmp_path)), mine, {4, 1})
    write(str(tmp_path), state)
    assert (tmp_path / FILE).read_text() == json.dumps({"saved": mine, "excluded_nodes": ["batch0", "n3"], "faults_done": [1, 4], "batch_node": "batch0"}, indent=2) + "\n"


def test_a_spares_last_resort_changes_only_the_excluded_nodes():
    from ckptless_hpc.rundir.restart import after_last_resort

    previous = {"saved": SAVED, "excluded_nodes": ["n3"], "faults_done": [1], "batch_node": "batch0"}
    assert after_last_resort(previous) == dict(previous, excluded_nodes=["batch0", "n3"])
    assert previous["excluded_nodes"] == ["n3"]  # pure: the mapping read is not changed
    assert after_last_resort({}) == {"excluded_nodes": []}  # no restart.json: what the worker wrote before (no key added)
    assert after_last_resort({}, None, {2}) == {"saved": None, "faults_done": [2], "excluded_nodes": []}


def test_an_unreadable_restart_json_reads_as_empty(tmp_path):
    from ckptless_hpc.rundir.restart import read_or_empty

    assert read_or_empty(str(tmp_path)) == {}
    (tmp_path / FILE).write_text('{"saved": ')
    assert read_or_empty(str(tmp_path)) == {}
