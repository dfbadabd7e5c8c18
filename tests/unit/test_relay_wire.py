"""The relay's pure parts (ckptless_hpc/control/relay.py): batching within the frame limit, entries,
heartbeat summaries; and the coordinator's message shapes that relays carry. The relay's real
behaviour (processes, sockets, kills) is proven end to end in tests/e2e/test_relay.py."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ckptless_hpc.control import wire, relay
from ckptless_hpc.control import messages

pytestmark = pytest.mark.timeout(30)


def _decode(frame: bytes) -> dict:
    (n,) = wire._HDR.unpack(frame[:4])
    assert n == len(frame) - 4
    return wire.decode(frame[4:])


def test_batches_keep_order_and_stay_within_the_frame_limit():
    bodies = [wire.encode_body({"type": "assign", "gen": 1, "pad": "x" * (100 + i)}) for i in range(50)]
    entries = [relay.entry(f"n0.{i}", b) for i, b in enumerate(bodies)]
    frames = relay.batch_frames(relay.DOWN, entries, max_body=1000)
    assert len(frames) > 5  # the limit split the batch
    got = []
    for f in frames:
        assert len(f) - 4 <= 1000
        msg = _decode(f)
        assert msg["type"] == "down"
        got += msg["m"]
    assert [w for w, _ in got] == [f"n0.{i}" for i in range(50)]
    assert [m["pad"] for _, m in got] == ["x" * (100 + i) for i in range(50)]
    one = relay.batch_frames(relay.UP, entries[:3])  # under the real limit: one frame
    assert len(one) == 1 and _decode(one[0])["type"] == "up"


def test_an_entry_for_many_workers_and_one_encoding():
    e = relay.entry(["n1.0", "n1.1"], wire.encode_body({"type": "abort", "gen": 4}))
    assert json.loads(e) == [["n1.0", "n1.1"], {"type": "abort", "gen": 4}]
    assert json.loads(relay.message_entry("n1.0", {"type": "held", "step": 3})) == ["n1.0", {"type": "held", "step": 3}]
    with pytest.raises(wire.ProtocolError, match="frame limit"):
        relay.message_entry("n1.0", {"type": "x", "pad": "y" * wire.MAX_FRAME})


def test_heartbeats_fold_into_one_summary_per_interval():
    up = relay.Upstream("n2", 0.5, deliver=lambda w, m: None, on_closed=lambda why: None)
    up.forward("n2.0", {"type": "hb", "step": 10, "compute_s": 0.01})
    up.forward("n2.1", {"type": "hb", "step": 11, "compute_s": 0.02})
    up.forward("n2.0", {"type": "hb", "step": 12, "compute_s": 0.03})  # the newest counts
    heard = dict(up._heard)
    s = up.summary(max(heard.values()) + 0.25)
    assert s["type"] == "hbs" and set(s["w"]) == {"n2.0", "n2.1"}
    assert s["w"]["n2.0"][1:] == [12, 0.03] and s["w"]["n2.1"][1:] == [11, 0.02]
    assert 0.2 <= s["w"]["n2.0"][0] <= 0.3
    again = up.summary(max(heard.values()) + 2.0)  # nothing new: ages grow, no beat repeated
    assert again["w"]["n2.0"][1:] == [None, None] and again["w"]["n2.0"][0] >= 1.9
    up.gone("n2.1", "EOF")
    assert set(up.summary(0.0)["w"]) == {"n2.0"}  # a gone worker is no longer vouched for


def test_socket_paths_are_short_unguessable_and_per_node():
    secret = "ab" * 32
    a = relay.socket_path(secret, "node1")
    assert len(a) < 100 and a == relay.socket_path(secret, "node1")  # every task of the node's step finds it
    assert a != relay.socket_path("cd" * 32, "node1") and a != relay.socket_path(secret, "node2")  # without the secret, unknowable
    assert os.path.basename(os.path.dirname(a)).startswith("ckptless-relay-")  # a directory of its own, not a file in /tmp


def test_the_relay_listens_only_in_a_private_directory(tmp_path):
    mine = tmp_path / "mine" / "relay.sock"
    relay.private_dir(str(mine))
    assert stat.S_IMODE(os.stat(mine.parent).st_mode) == 0o700
    relay.private_dir(str(mine))  # already ours and private (a launcher's mkdtemp, a relay restarted): taken
    opened = tmp_path / "opened"
    opened.mkdir(mode=0o755)
    os.chmod(opened, 0o755)
    with pytest.raises(relay.RelayError, match=r"not a private directory of this user .*mode 0o755.*HINT: remove it"):
        relay.private_dir(str(opened / "relay.sock"))
    if os.geteuid() == 0:  # another user's directory, created first at the path (as root: a real other owner)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(relay.RelayError, match="owner uid 65534"):
            relay.private_dir(str(theirs / "relay.sock"))


def test_a_rankless_assign_and_the_checks_parse_keeps():
    m = messages.assign(3, None, 8, 100, (), {}, [])
    assert "rank" not in m and m["step"] == 100 and m["sources"] == []
    assert messages.assign(3, 2, 8, 100, (), {}, [])["rank"] == 2
    assert messages.parse({"type": "ready", "gen": 2.0}).gen == 2  # an integral float is an int
    with pytest.raises(messages.MessageError, match="'gen'"):
        messages.parse({"type": "held", "gen": True, "step": 1})
    with pytest.raises(messages.MessageError, match="missing"):
        messages.parse({"type": "ready", "gen": None})
    held = messages.parse({"type": "held", "gen": 1, "abort_gen": 2, "step": 40, "reason": "abort"})
    assert (held.gen, held.abort_gen, held.step, held.pid) == (1, 2, 40, None)


def test_the_coordinator_reads_a_relay_link(tmp_path):
    """The coordinator's side of a relay (control/server.py), driven with frames and a
    writer that only collects (no socket): hellos accepted, a bad one refused without the
    node, ages from the summary, a gone worker lost, what is sent batched per loop iteration."""
    import asyncio

    from ckptless_hpc.control.server import RelayLink, RelayedWriter
    from ckptless_hpc.coordinator.shell import Coordinator
    from coordlib import FakeWriter, NoLauncher, cfg

    class LinkWriter(FakeWriter):
        def get_extra_info(self, name, default=None):
            return default

    def down(frames):
        return [e for f in frames for e in _decode(f)["m"]]

    async def go() -> None:
        c = Coordinator.from_config(cfg("task=mlp", "cluster.nodes=2", "cluster.workers_per_node=2", "cluster.control=node"), str(tmp_path), NoLauncher(), "s" * 64, "job-relay")
        c.members.add_node("local1", "active")
        c.control.ready.set()
        c.store_addr = "127.0.0.1:1"
        w = LinkWriter()
        link = c.control._accept_relay({"type": "relay", "node": "local1", "pid": 9, "host": "h"}, w)
        assert isinstance(link, RelayLink)
        with pytest.raises(wire.ProtocolError, match="did not start"):
            c.control._accept_relay({"type": "relay", "node": "elsewhere"}, LinkWriter())
        with pytest.raises(wire.ProtocolError, match="second relay"):
            c.control._accept_relay({"type": "relay", "node": "local1"}, LinkWriter())
        hello = {"type": "hello", "node": "local1", "pid": 5, "host": "127.0.0.1"}
        c.control._on_relay_frame(link, {"type": "up", "m": [["local1.0", dict(hello, local=0)], ["local1.1", dict(hello, local=1)],
                                                     ["local1.1", dict(hello, local=1)]]})  # the third: already connected
        await asyncio.sleep(0)
        assert set(link.recs) == {"local1.0", "local1.1"} and isinstance(c.workers["local1.0"].writer, RelayedWriter)
        sent = down(w.frames)
        assert len(w.frames) == 1  # the two configs and the refusal: one frame
        assert [(t, m["type"]) for t, m in sent] == [("local1.0", "config"), ("local1.1", "config"), ("local1.1", "dropped")]
        c.events.close()
        rejected = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines() if '"connection_rejected"' in line]
        assert len(rejected) == 1 and "local1.1" in rejected[0]["peer"], rejected
        c.record.events = type(c.events)(str(tmp_path / "events.jsonl"), "job-relay", c.clock)

        rec = c.workers["local1.0"]
        now = c.clock()
        rec.last_seen = now - 10.0  # last heard long ago, as far as the coordinator knows
        c.control._on_relay_frame(link, {"type": "hbs", "t": now, "w": {"local1.0": [2.0, 40, 0.01], "local1.1": [0.1, None, None], "ghost.0": [0.0, 1, 1]}})
        assert now - 2.5 < rec.last_seen < now - 1.5  # its age at the relay, not the summary's arrival
        c.control._on_relay_frame(link, {"type": "hbs", "t": now, "w": {"local1.0": [5.0, None, None]}})
        assert rec.last_seen > now - 2.5  # an older age never moves it back
        w.frames.clear()
        c.control.broadcast(["local1.0", "local1.1"], {"type": "abort", "gen": 1})
        await asyncio.sleep(0)
        assert down(w.frames) == [[["local1.0", "local1.1"], {"type": "abort", "gen": 1}]]  # one entry for the node

        c.control._on_relay_frame(link, {"type": "up", "m": [["local1.1", {"type": "gone", "why": "control connection closed (EOF)"}]]})
        assert c.workers["local1.1"].role == "dead" and "local1.1" not in link.recs
        c.events.close()

    asyncio.run(go())


def test_a_relayed_slurm_step_has_one_more_task_the_relay():
    from ckptless_hpc.launch.slurm import node_step_argv
    from coordlib import cfg

    relayed = node_step_argv(cfg("cluster=slurm", "cluster.workers_per_node=4", "cluster.control=node"), "n7", 4, "10.0.0.1:5000", "123", "/r/logs/n7.%t.log")
    assert "--ntasks=5" in relayed and "--overcommit" in relayed and "--nodelist=n7" in relayed
    command = relayed[relayed.index("--") + 1:]
    assert command[1:3] == ["-m", "ckptless_hpc.launch.node_task"] and "10.0.0.1:5000" in command
    plain = node_step_argv(cfg("cluster=slurm", "cluster.workers_per_node=4"), "n7", 4, "10.0.0.1:5000", "123", "/r/logs/n7.%t.log")
    assert "--ntasks=4" in plain and "--overcommit" not in plain and "ckptless_hpc.worker" in plain
