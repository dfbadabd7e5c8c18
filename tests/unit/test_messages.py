"""control/messages.py: every message encodes to the bytes its sender wrote before the classes
existed (the literals below are copied from those senders), parses back to itself, and a bad
field is named with its value and a HINT."""

import pytest

from ckptless_hpc.control import messages as M
from ckptless_hpc.control import wire

pytestmark = pytest.mark.timeout(30)

TB = "Traceback (most recent call last): ..."
SRC = [{"worker": "n1.0", "host": "10.0.0.2", "port": 4100}]

# (the message, today's dict literal at its sender, the registry its receiver parses it with)
CASES = [
    # worker -> coordinator
    (M.Hello("n0", 1, 42, "10.0.0.1", "7.1"), {"type": "hello", "node": "n0", "local": 1, "pid": 42, "host": "10.0.0.1", "slurm_step": "7.1"}, M.CONNECTING),
    (M.Heartbeat(3, 17, True, 0.25), {"type": "hb", "gen": 3, "step": 17, "training": True, "compute_s": 0.25}, M.CONNECTING),
    (M.Probe("n0.1", "dropped: checking"), {"type": "probe", "worker": "n0.1", "why": "dropped: checking"}, M.CONNECTING),
    (M.Built(4000, 1024, 10, 2, 1, pid=42), {"type": "built", "state_port": 4000, "pid": 42, "state_bytes": 1024, "params": 10, "buckets": 2, "buffers": 1}, M.KINDS),
    (M.Metrics(5, 1.5, 0.1, gen=2, lr=0.001, grad_norm=0.5, samples=80.0, skipped=None, skipped_total={}, metrics=None),
     {"type": "metrics", "gen": 2, "step": 5, "loss": 1.5, "lr": 0.001, "grad_norm": 0.5, "step_s": 0.1, "samples": 80.0, "skipped": None, "skipped_total": {}, "metrics": None}, M.KINDS),
    (M.Eval(5, {"acc": 0.5}, gen=2, eval_s=0.3), {"type": "eval", "gen": 2, "step": 5, "metrics": {"acc": 0.5}, "eval_s": 0.3}, M.KINDS),
    (M.Held(1, 2, 40, 42, M.HeldReason.ABORT), {"type": "held", "gen": 1, "abort_gen": 2, "step": 40, "pid": 42, "reason": "abort"}, M.KINDS),
    (M.Held(1, None, 40, 42, "start failed: x", inventory={"0": [40]}, blame=["n1.0"]),
     {"type": "held", "gen": 1, "abort_gen": None, "step": 40, "pid": 42, "reason": "start failed: x", "blame": ["n1.0"], "inventory": {"0": [40]}}, M.KINDS),
    (M.Joining(3, 40), {"type": "joining", "gen": 3, "step": 40}, M.KINDS),
    (M.Ready(3, 1, 42, 0.5), {"type": "ready", "gen": 3, "rank": 1, "pid": 42, "form_s": 0.5}, M.KINDS),
    (M.Fetched(3, "n1.0,n2.0", 1024, 0.1, 0.01), {"type": "fetched", "gen": 3, "source": "n1.0,n2.0", "bytes": 1024, "seconds": 0.1, "apply_s": 0.01}, M.KINDS),
    (M.TransferFailed(3, "n1.0", "state: refused"), {"type": "transfer_error", "gen": 3, "source": "n1.0", "error": "state: refused"}, M.KINDS),
    (M.FaultFired(0, "kill", "step", 1, 2, 30, 42), {"type": "fault", "index": 0, "kind": "kill", "at": "step", "gen": 1, "rank": 2, "step": 30, "pid": 42}, M.KINDS),
    (M.Done(3, "ab" * 32, 1, 100), {"type": "done", "gen": 3, "rank": 1, "step": 100, "sha256": "ab" * 32}, M.KINDS),
    (M.Done(3, "ab" * 32, 1, 100, 1, {"own": 10}, {"ack_s": 0.1}),
     {"type": "done", "gen": 3, "rank": 1, "step": 100, "sha256": "ab" * 32, "shard": 1, "copies_bytes": {"own": 10}, "copy_costs": {"ack_s": 0.1}}, M.KINDS),
    (M.Saved("/r/state/e.pt", 40, "cd" * 32, bytes=100, written=True), {"type": "saved", "path": "/r/state/e.pt", "step": 40, "sha256": "cd" * 32, "bytes": 100, "written": True}, M.KINDS),
    (M.Saved("/r/s1.pt", 40, "cd" * 32, 1, 100, False), {"type": "saved", "path": "/r/s1.pt", "step": 40, "sha256": "cd" * 32, "bytes": 100, "written": False, "shard": 1}, M.KINDS),
    (M.SaveFailed("/r/s1.pt", "disk full", 40), {"type": "save_failed", "path": "/r/s1.pt", "step": 40, "error": "disk full"}, M.KINDS),
    (M.Exported(40, {"path": "m.pt", "sha256": "x", "bytes": 1}, {"path": "d", "index": "i", "files": {}}),
     {"type": "exported", "step": 40, "model": {"path": "m.pt", "sha256": "x", "bytes": 1}, "state": {"path": "d", "index": "i", "files": {}}}, M.KINDS),
    (M.PeriodicSaved("/r/p.pt", 40, 0, "ef", "01", 100), {"type": "periodic_saved", "path": "/r/p.pt", "step": 40, "shard": 0, "state_sha256": "ef", "sha256": "01", "bytes": 100}, M.KINDS),
    (M.PeriodicFailed("/r/p.pt", "disk full", 40), {"type": "periodic_failed", "path": "/r/p.pt", "step": 40, "error": "disk full"}, M.KINDS),
    (M.ExportFailed("/r/model.pt", "no index"), {"type": "export_failed", "path": "/r/model.pt", "error": "no index"}, M.KINDS),
    (M.LoadFailed("/r/e.pt", "damaged"), {"type": "load_failed", "path": "/r/e.pt", "error": "damaged"}, M.KINDS),
    (M.NonFinite(7, "nan", 1.0, 0, 2, 6, None), {"type": "nonfinite", "gen": 2, "rank": 0, "step": 7, "loss": "nan", "grad_norm": 1.0, "held": 6, "skipped": None}, M.KINDS),
    (M.StartupError(TB), {"type": "startup_error", "traceback": TB}, M.KINDS),
    (M.WorkerFailed(TB, "rank 1 gen 2 step 5, assign"), {"type": "worker_failed", "traceback": TB, "during": "rank 1 gen 2 step 5, assign"}, M.KINDS),
    # coordinator -> worker
    (M.Config("j1", {"cluster": {}}, "10.0.0.9:4001", "/r", True), {"type": "config", "job": "j1", "config": {"cluster": {}}, "store": "10.0.0.9:4001", "run_dir": "/r", "spare": True}, M.TO_WORKER),
    (M.Assign(3, None, 8, 100, [], []), {"type": "assign", "gen": 3, "world": 8, "step": 100, "sources": [], "faults_done": []}, M.TO_WORKER),
    (M.Assign(3, 2, 8, 100, SRC, [0], 1, [[1, "n1.0"]], [2], {"n1.0": 1}),
     {"type": "assign", "gen": 3, "rank": 2, "world": 8, "step": 100, "sources": SRC, "faults_done": [0], "shard": 1, "holders": [[1, "n1.0"]], "holds": [2], "load": {"n1.0": 1}}, M.TO_WORKER),
    (M.Abort(3), {"type": "abort", "gen": 3}, M.TO_WORKER),
    (M.Stop(), {"type": "stop"}, M.TO_WORKER),
    (M.Stop("/r/state/e.pt"), {"type": "stop", "save": "/r/state/e.pt"}, M.TO_WORKER),
    (M.FaultAck(2), {"type": "fault_ack", "index": 2}, M.TO_WORKER),
    (M.Inject(2), {"type": "inject", "index": 2}, M.TO_WORKER),
    (M.CopyAt(50), {"type": "copy_at", "step": 50}, M.TO_WORKER),
    (M.Save("/r/s/1.pt", 1, 40), {"type": "save", "path": "/r/s/1.pt", "shard": 1, "step": 40}, M.TO_WORKER),
    (M.Export(["/r/s/0.pt"], "/r/s/model.pt", 40), {"type": "export", "files": ["/r/s/0.pt"], "out": "/r/s/model.pt", "step": 40}, M.TO_WORKER),
    (M.Dropped("declared failed"), {"type": "dropped", "why": "declared failed"}, M.TO_WORKER),
    # a node's relay <-> the coordinator
    (M.RelayHello("n0", 42, "10.0.0.1"), {"type": "relay", "node": "n0", "pid": 42, "host": "10.0.0.1"}, M.RELAY),
    (M.Up([["n0.0", {"type": "ready", "gen": 1}]]), {"type": "up", "m": [["n0.0", {"type": "ready", "gen": 1}]]}, M.RELAY),
    (M.Down([[["n0.0", "n0.1"], {"type": "abort", "gen": 1}]]), {"type": "down", "m": [[["n0.0", "n0.1"], {"type": "abort", "gen": 1}]]}, M.RELAY),
    (M.Gone("control connection closed (eof)"), {"type": "gone", "why": "control connection closed (eof)"}, M.RELAY),
    (M.HeartbeatSummary(1.5, {"n0.0": [0.1, 5, 0.2], "n0.1": [0.2, None, None]}), {"type": "hbs", "t": 1.5, "w": {"n0.0": [0.1, 5, 0.2], "n0.1": [0.2, None, None]}}, M.RELAY),
    # the handshake
    (M.Challenge("ab" * 16), {"type": "challenge", "nonce": "ab" * 16}, M.HANDSHAKE),
    (M.Auth("ff" * 32, "cd" * 16), {"type": "auth", "mac": "ff" * 32, "nonce": "cd" * 16}, M.HANDSHAKE),
    (M.Welcome("ee" * 32), {"type": "welcome", "mac": "ee" * 32}, M.HANDSHAKE),
    # the state port
    (M.Fetch(3, 40), {"type": "fetch", "gen": 3, "step": 40}, M.STATE_PORT),
    (M.Fetch(3, 40, 1, M.Part.REST, 1, 2), {"type": "fetch", "gen": 3, "step": 40, "shard": 1, "part": "rest", "index": 1, "of": 2}, M.STATE_PORT),
    (M.StateHeader([{"name": "w", "dtype": "torch.float32", "shape": [2]}], {"step": 40}), {"type": "state", "entries": [{"name": "w", "dtype": "torch.float32", "shape": [2]}], "meta": {"step": 40}}, M.STATE_PORT),
    (M.End("0123456789abcdef"), {"type": "end", "xxh3_64": "0123456789abcdef"}, M.STATE_PORT),
    (M.Replica(3, 1, 40), {"type": "replica", "gen": 3, "shard": 1, "step": 40}, M.STATE_PORT),
    (M.Ack(40), {"type": "ack", "step": 40}, M.STATE_PORT),
    (M.Refused("stale: step 39 < 40"), {"type": "refused", "reason": "stale: step 39 < 40"}, M.STATE_PORT),
    # the store
    (M.StoreRequest(M.StoreOp.SET, key="k", value="dg=="), {"type": "store", "op": "set", "key": "k", "value": "dg=="}, M.STORE_REQUESTS),
    (M.StoreRequest("get", key="k", timeout_s=30.0), {"type": "store", "op": "get", "key": "k", "timeout_s": 30.0}, M.STORE_REQUESTS),
    (M.StoreRequest("wait", keys=["a", "b"], timeout_s=30.0), {"type": "store", "op": "wait", "keys": ["a", "b"], "timeout_s": 30.0}, M.STORE_REQUESTS),
    (M.StoreRequest("add", key="k", amount=1), {"type": "store", "op": "add", "key": "k", "amount": 1}, M.STORE_REQUESTS),
    (M.StoreRequest("check", keys=["a"]), {"type": "store", "op": "check", "keys": ["a"]}, M.STORE_REQUESTS),
    (M.StoreRequest("num_keys"), {"type": "store", "op": "num_keys"}, M.STORE_REQUESTS),
    (M.StoreRequest("compare_set", key="k", expected="", desired="dg=="), {"type": "store", "op": "compare_set", "key": "k", "expected": "", "desired": "dg=="}, M.STORE_REQUESTS),
    (M.StoreAnswer(True), {"type": "store", "ok": True}, M.STORE_ANSWERS),
    (M.StoreAnswer(True, None), {"type": "store", "ok": True, "value": None}, M.STORE_ANSWERS),
    (M.StoreAnswer(True, 3), {"type": "store", "ok": True, "value": 3}, M.STORE_ANSWERS),
    (M.StoreAnswer(False, error="timed out after 1s waiting for ['k']"), {"type": "store", "ok": False, "error": "timed out after 1s waiting for ['k']"}, M.STORE_ANSWERS),
]


def _id(case):
    return type(case[0]).__name__ + ":" + ",".join(case[1])[:40]


@pytest.mark.parametrize("msg,literal,kinds", CASES, ids=[_id(c) for c in CASES])
def test_encode_is_todays_bytes(msg, literal, kinds):
    assert wire.encode(msg.encode()) == wire.encode(literal)
    assert list(msg.encode()) == list(literal)  # the same keys in the same order


@pytest.mark.parametrize("msg,literal,kinds", CASES, ids=[_id(c) for c in CASES])
def test_round_trip(msg, literal, kinds):
    assert M.parse(wire.decode(wire.encode_body(msg.encode())), kinds) == msg


def test_every_class_is_covered():
    classes = {c for kinds in (M.KINDS, M.CONNECTING, M.TO_WORKER, M.RELAY, M.HANDSHAKE, M.STATE_PORT, M.STORE_REQUESTS, M.STORE_ANSWERS) for c in kinds.values()}
    assert classes == {type(c[0]) for c in CASES}


def test_builders_are_todays_dicts():
    ends = {"n1.0": ("10.0.0.2", 4100)}
    assert M.assign(3, None, 8, 100, (), {}, []) == {"type": "assign", "gen": 3, "world": 8, "step": 100, "sources": [], "faults_done": []}
    assert list(M.assign(3, 2, 8, 100, ["n1.0"], ends, [0], {"n1.0": 1}, {"shard": 1, "holders": [], "holds": [2]})) == [
        "type", "gen", "rank", "world", "step", "sources", "faults_done", "shard", "holders", "holds", "load"]
    assert M.assign(3, 2, 8, 100, ["n1.0"], ends, [], {}, {})["sources"] == SRC  # an empty load or layout: no such fields
    assert "load" not in M.assign(3, 2, 8, 100, (), ends, [], {}) and "shard" not in M.assign(3, 2, 8, 100, (), ends, [], None, {})
    assert M.heartbeat(gen=1, step=2, training=False, compute_s=None) == {"type": "hb", "gen": 1, "step": 2, "training": False, "compute_s": None}
    assert M.heartbeat() == {"type": "hb"}
    assert wire.encode(M.heartbeat_summary(2.0, {"a": [0.1, 1, 0.2]})) == wire.encode({"type": "hbs", "t": 2.0, "w": {"a": [0.1, 1, 0.2]}})
    assert M.UP_HEAD + b"]}" == wire.encode_body(M.Up([]).encode()) and M.DOWN_HEAD + b"]}" == wire.encode_body(M.Down([]).encode())


def test_enums_are_todays_strings():
    assert wire.encode_body(M.Held(reason=M.HeldReason.ABORT).encode()) == wire.encode_body({"type": "held", "gen": None, "abort_gen": None, "step": None, "pid": None, "reason": "abort"})
    assert M.HeldReason.ABORT == "abort" and M.Part.FIRST == "first" and M.StoreOp.COMPARE_SET == "compare_set"
    assert M.Fetch(1, 2, part=M.Part.ALL).encode() == {"type": "fetch", "gen": 1, "step": 2}


def test_bad_fields_are_named_with_value_and_hint():
    with pytest.raises(M.MessageError, match=r"'ready' message: field 'gen' is missing\. HINT: worker and coordinator must be the same ckptless_hpc version"):
        M.parse({"type": "ready"})
    with pytest.raises(M.MessageError, match=r"'done' message: field 'sha256' = 7 is not of type str\. HINT: "):
        M.parse({"type": "done", "gen": 1, "sha256": 7})
    with pytest.raises(M.MessageError, match=r"'held' message: field 'gen' = True is not of type int\. HINT: "):
        M.parse({"type": "held", "gen": True})
    with pytest.raises(M.MessageError, match=r"'ready' message: field 'gen' = 2\.5 is not of type int"):
        M.parse({"type": "ready", "gen": 2.5})
    with pytest.raises(M.MessageError, match=r"'abort' message: field 'gen' = '3' is not of type int\. HINT: "):
        M.parse({"type": "abort", "gen": "3"}, M.TO_WORKER)
    with pytest.raises(M.MessageError, match=r"'fetch' message: field 'step' is missing\. HINT: "):
        M.parse({"type": "fetch", "gen": 1}, M.STATE_PORT)


def test_parse_keeps_todays_leniency():
    assert M.parse({"type": "ready", "gen": 2.0}).gen == 2  # an integral float is an int
    assert type(M.parse({"type": "ready", "gen": 2.0}).gen) is int
    assert M.parse({"type": "held", "gen": 0, "abort_gen": 1, "step": 5, "pid": 3, "reason": "abort", "t": 1.0}) == M.Held(0, 1, 5, 3, "abort")  # t: ignored
    assert M.parse({"type": "no-such-kind"}) is None
    assert M.parse({"type": "hello", "node": "n0", "local": 0, "pid": 1, "host": "h"}) is None  # the coordinator reads a hello before, in place
    assert M.parse({"type": "assign", "gen": 1}) is None  # not a worker's message


def test_held_reasons_and_kind():
    assert M.held_reason(M.START_FAILED, "no source") == "start failed: no source"
    assert M.Held(reason=M.held_reason(M.START_FAILED, "x")).start_failed and not M.Held(reason="abort").start_failed
    assert not M.Held(reason=M.held_reason(M.COLLECTIVE_ERROR, "gloo")).start_failed and not M.Held().start_failed
    assert M.kind({"type": "stop", "save": 3}, M.TO_WORKER) is M.Stop  # fields unchecked
    assert M.kind({"type": "hb"}, M.TO_WORKER) is None


@pytest.mark.parametrize("rank", [None, 0, 5])
@pytest.mark.parametrize("load", [None, {}, {"n1.0": 2}])
@pytest.mark.parametrize("layout", [None, {}, {"shard": 1, "holders": [[2, "n1.0"]], "holds": [3]}])
def test_the_assign_builder_is_the_class_encoded(rank, load, layout):
    """``assign`` (the coordinator's hot path) writes the dict itself: the same bytes as the class."""
    ends = {"n1.0": ("10.0.0.2", 4100)}
    built = M.assign(3, rank, 8, 100, ["n1.0"], ends, [0], load, layout)
    assert wire.encode(built) == wire.encode(M.Assign(3, rank, 8, 100, SRC, [0], **(layout or {}), load=load or None).encode())
    assert M.parse(built, M.TO_WORKER) == M.Assign(3, rank, 8, 100, SRC, [0], **(layout or {}), load=load or None)
