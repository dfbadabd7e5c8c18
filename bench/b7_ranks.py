"""``python -m bench.b7_ranks``: one process carrying many simulated ranks for B7.

Each simulated rank is one real control connection doing the worker's real protocol: the
HMAC handshake (paced and retried as ``wire.connect_paced`` does), hello, built, a
heartbeat every interval, assign -> joining -> ready, abort -> held, fetched when it is behind,
rank 0's per-step metrics, done, stop. It trains nothing: the step is a shared clock, ``--rate``
steps per second since ``--epoch`` (so that ranks in different processes agree, as ranks in one
collective do), never below the step its generation started at; an abort holds the step floored
to a multiple of ``--commit-every`` (every rank holds the same committed step, as real ones do;
a floor that falls inside the abort's delivery splits the world across two steps, which real
jobs see too). SIGUSR1 closes the control
connection of ``--victim`` (a failed rank). Writes what it saw to ``--out`` (JSON). ``--watch WID``:
every control message that simulated rank receives or sends (heartbeats and metrics left out),
with its time and size, in ``watch`` of the output: one survivor's share of a recovery (bench B5).

``--control node`` (``cluster.control=node``): each simulated node is one real relay
connection (``ckptless_hpc.control.relay.Upstream``, the relay process's own upstream code: batched
frames, one heartbeat summary per interval) carrying its ranks in-process, where the relay
process would read them from the node-local sockets of real workers; the victim's closed
connection is what the relay then reports (``gone``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, Optional

from ckptless_hpc.control import messages, wire
from ckptless_hpc.control.messages import Abort, Assign, Built, Config, Done, Dropped, Fetched, Hello, Metrics, Stop
from ckptless_hpc.control.relay import Upstream

SHA = "0" * 64
PID = os.getpid()
EPOCH = [0.0]
WATCHED: List[List[Any]] = []  # --watch: [time, "recv"|"sent", type, bytes] of the watched rank's control messages
ROUTINE = ("hb", "metrics")  # the steady traffic, not a recovery's


def _watch(r: "Rank", direction: str, kind: str, size: int) -> None:
    if r.watched and kind not in ROUTINE:
        WATCHED.append([time.time(), direction, kind, size])


class Rank:
    def __init__(self, node: str, local: int) -> None:
        self.node, self.local = node, local
        self.wid = f"{node}.{local}"
        self.reader: Any = None
        self.writer: Any = None
        self.gen, self.rank = -1, None
        self.base, self.t0, self.training = 0, 0.0, False
        self.held_step = 0
        self.done_gen = -1
        self.metrics_step = 0
        self.attempts = 0
        self.stopped = False
        self.up: Optional[Upstream] = None  # --control node: its node's relay connection
        self.gone = False
        self.watched = False  # --watch: this rank's control messages are recorded

    def step(self, now: float, rate: float, steps: int) -> int:
        if not self.training:
            return self.held_step
        return min(steps, max(self.base, int((now - EPOCH[0]) * rate)))

    def send_body(self, body: str) -> None:
        """A message already written as JSON (``body`` without its closing brace: the time is
        added here): the recovery's many held/joining/ready cost the simulated ranks no
        json.dumps, so that the CPU they share with the coordinator stays small."""
        if self.watched:
            _watch(self, "sent", body.split('"type":"', 1)[1].split('"', 1)[0], len(body) + 24)  # + the time field
        if self.up is not None:
            if not self.gone and not self.stopped:
                self.up.forward_entry(self.wid, f'["{self.wid}",{body},"t":{time.time()}}}]'.encode())
        elif self.writer is not None and not self.writer.is_closing():
            self.writer.write(wire.frame(f'{body},"t":{time.time()}}}'.encode()))

    def send(self, msg: Dict[str, Any]) -> None:
        if self.watched:
            _watch(self, "sent", str(msg.get("type")), len(json.dumps(msg)) + 24)
        if self.up is not None:
            if not self.gone and not self.stopped:
                msg["t"] = time.time()
                self.up.forward(self.wid, msg)
        elif self.writer is not None and not self.writer.is_closing():
            msg["t"] = time.time()
            self.writer.write(wire.encode(msg))


class Sim:
    def __init__(self, a: argparse.Namespace, ranks: List[Rank]) -> None:
        self.a, self.ranks = a, ranks
        self.host, _, port = a.address.rpartition(":")
        self.port = int(port)
        self.secret = wire.load_secret()
        self.steps = 1 << 40
        self.rng = random.Random(a.index)
        self.assigns: Dict[int, List[float]] = {}  # gen -> [first, last, count] received
        self.aborts: Dict[int, List[float]] = {}  # the same, of aborts
        self.zero: Optional[Rank] = None  # the rank that is rank 0 here, if any (it sends the metrics)
        self.closed: Optional[Dict[str, Any]] = None
        self.t_connected: List[float] = []

    # ---------------------------------------------------------------- connection
    async def _attempt(self, r: Rank, wait_s: float) -> None:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), wait_s)
        try:
            await wire.aclient_handshake(reader, writer, self.secret, wait_s)
        except BaseException:
            writer.close()
            raise
        r.reader, r.writer = reader, writer

    async def connect(self, r: Rank) -> bool:
        deadline = time.monotonic() + self.a.connect_timeout
        while time.monotonic() < deadline:
            try:
                await self._attempt(r, wire.attempt_wait_s(r.attempts))
                self.t_connected.append(time.time())
                return True
            except (asyncio.TimeoutError, ConnectionError, OSError, asyncio.IncompleteReadError):
                pass
            r.attempts += 1
            await asyncio.sleep(wire.backoff_s(r.attempts, self.rng))
        return False

    # ---------------------------------------------------------------- one rank's messages
    async def serve(self, r: Rank) -> None:
        if not await self.connect(r):
            return
        r.send(Hello(r.node, r.local, os.getpid(), "127.0.0.1", None).encode())
        closed: "asyncio.Future[str]" = asyncio.get_running_loop().create_future()
        # frames handled as they arrive (the coordinator's own reader): the simulated ranks must
        # cost as little CPU as possible, since they share this machine's cores with it
        wire.FrameProtocol(lambda m: self.on_message(r, m), lambda why: closed.done() or closed.set_result(why)).take_over(r.reader, r.writer)
        await closed
        r.writer.close()
        r.writer = None

    def on_message(self, r: Rank, msg: Dict[str, Any], now: Optional[float] = None) -> None:
        """``now``: when the message reached the rank's node (its relay hands a frame's entries
        to the node's ranks at once); by default, now."""
        kind, now = messages.kind(msg, messages.TO_WORKER), now or time.time()  # read in place: the simulated ranks' CPU is the coordinator's
        if r.watched:
            _watch(r, "recv", str(msg.get("type")), len(json.dumps(msg)))
        if kind is Config:
            self.steps = int(msg["config"]["train"]["steps"])
            r.send(Built(1, 0, 0, 1, 0, pid=os.getpid()).encode())
        elif kind is Abort:
            seen = self.aborts.setdefault(int(msg["gen"]), [now, now, 0])
            seen[0], seen[1], seen[2] = min(seen[0], now), max(seen[1], now), seen[2] + 1
            grain = self.a.commit_every
            r.held_step, r.training = max(r.base, r.step(now, self.a.rate, self.steps) // grain * grain), False
            r.send_body(f'{{"type":"held","gen":{r.gen},"abort_gen":{int(msg["gen"])},"step":{r.held_step},"pid":{PID},"reason":"abort"')
        elif kind is Assign:
            self.on_assign(r, msg, now)
        elif kind is Stop:
            r.stopped = True
            if r.writer is not None:
                r.writer.close()

    def on_assign(self, r: Rank, msg: Dict[str, Any], now: float) -> None:
        gen, target = int(msg["gen"]), int(msg["step"])
        seen = self.assigns.setdefault(gen, [now, now, 0])
        seen[0], seen[1], seen[2] = min(seen[0], now), max(seen[1], now), seen[2] + 1
        r.gen, r.rank = gen, int(msg["rank"]) if msg.get("rank") is not None else r.rank  # none: it keeps its rank
        if r.rank == 0:
            self.zero = r
        if r.held_step != target:
            src = (msg.get("sources") or [{}])[0].get("worker")
            r.send(Fetched(gen, src, 0, 0.0, 0.0).encode())
        r.send_body(f'{{"type":"joining","gen":{gen},"step":{target}')
        r.send_body(f'{{"type":"ready","gen":{gen},"rank":{r.rank},"pid":{PID},"form_s":0.0')
        r.base, r.t0, r.training, r.held_step = target, time.time(), True, target
        r.metrics_step = max(target, r.step(now, self.a.rate, self.steps) - 1)

    # ---------------------------------------------------------------- periodic senders
    async def heartbeats(self) -> None:
        slots = max(1, int(round(self.a.interval / 0.02)))
        buckets: List[List[Rank]] = [[] for _ in range(slots)]
        for i, r in enumerate(self.ranks):
            buckets[(i * 7919 + self.a.index) % slots].append(r)
        tick = 0
        start = time.monotonic()
        while True:
            tick += 1
            await asyncio.sleep(max(0.0, start + tick * self.a.interval / slots - time.monotonic()))
            now = time.time()
            for r in buckets[tick % slots]:
                r.send(messages.heartbeat(gen=r.gen, step=r.step(now, self.a.rate, self.steps), training=r.training, compute_s=0.01))

    async def steps_loop(self) -> None:
        """Rank 0's metrics for every step, and done from every rank that reached the end (the
        per-rank pass only once the shared clock is near the end: it costs the simulated ranks'
        CPU, which this machine's coordinator shares)."""
        while True:
            await asyncio.sleep(0.01)
            now = time.time()
            near_end = (now - EPOCH[0]) * self.a.rate >= self.steps - 1
            for r in self.ranks if near_end else [z for z in (self.zero,) if z is not None]:
                if not r.training:
                    continue
                s = r.step(now, self.a.rate, self.steps)
                if r.rank == 0:
                    while r.metrics_step < s:
                        r.metrics_step += 1
                        r.send(Metrics(r.metrics_step, 1.0, 1.0 / self.a.rate, r.gen, 0.001, 1.0, 8, None, {}).encode())
                if s >= self.steps and r.done_gen != r.gen:
                    r.done_gen = r.gen
                    r.send(Done(r.gen, SHA, r.rank, s).encode())

    def kill_victim(self) -> None:
        for r in self.ranks:
            if r.wid == self.a.victim and r.up is not None and not r.gone:
                self.closed = {"worker": r.wid, "rank": r.rank, "t": time.time()}
                r.gone = True
                r.up.gone(r.wid, "control connection closed (EOF)")  # what the relay says when a worker's socket closes
            elif r.wid == self.a.victim and r.writer is not None:
                self.closed = {"worker": r.wid, "rank": r.rank, "t": time.time()}
                r.writer.transport.abort()  # the process is gone: its connection closes

    # ---------------------------------------------------------------- --control node
    async def serve_node(self, node: str, ranks: List[Rank]) -> None:
        """One relay connection for the node's ranks: they say hello through it, then talk."""
        closed: "asyncio.Future[str]" = asyncio.get_running_loop().create_future()
        by_wid = {r.wid: r for r in ranks}

        def deliver(wids: List[str], msg: Dict[str, Any]) -> None:
            now = time.time()
            for wid in wids:
                r = by_wid[wid]
                if messages.kind(msg, messages.TO_WORKER) is Dropped:
                    r.gone = True
                elif not r.gone:
                    self.on_message(r, msg, now)
            if all(r.stopped or r.gone for r in ranks):
                up.close()

        up = Upstream(node, self.a.interval, deliver, lambda why: closed.done() or closed.set_result(why))
        try:
            await up.connect(self.a.address, self.secret, "127.0.0.1", timeout_s=self.a.connect_timeout)
        except ConnectionError:
            return
        for r in ranks:
            r.up = up
            self.t_connected.append(time.time())
            r.send(Hello(r.node, r.local, os.getpid(), "127.0.0.1", None).encode())
        await closed

    async def run(self) -> Dict[str, Any]:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.kill_victim)
        t_start = time.time()
        periodic = [asyncio.ensure_future(self.heartbeats()), asyncio.ensure_future(self.steps_loop())]
        if self.a.control == "node":
            nodes: Dict[str, List[Rank]] = {}
            for r in self.ranks:
                nodes.setdefault(r.node, []).append(r)
            served = await asyncio.gather(*(self.serve_node(n, rs) for n, rs in nodes.items()))
        else:
            served = await asyncio.gather(*(self.serve(r) for r in self.ranks))
        for p in periodic:
            p.cancel()
        return {
            "index": self.a.index, "ranks": len(self.ranks), "t_start": t_start,
            "connected": len(self.t_connected), "lost": len(self.ranks) - len(self.t_connected),
            "retried": sum(1 for r in self.ranks if r.attempts),
            "attempts_max": max((r.attempts for r in self.ranks), default=0),
            "t_first_connected": min(self.t_connected, default=None), "t_last_connected": max(self.t_connected, default=None),
            "assigns": {str(g): v for g, v in self.assigns.items()}, "aborts": {str(g): v for g, v in self.aborts.items()}, "closed": self.closed, "served": len(served),
            "watch": {"worker": self.a.watch, "messages": WATCHED} if any(r.watched for r in self.ranks) else None,
        }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.b7_ranks")
    ap.add_argument("--address", required=True)
    ap.add_argument("--nodes", type=int, required=True, help="all nodes, spares included (sim0 ...)")
    ap.add_argument("--wpn", type=int, required=True)
    ap.add_argument("--index", type=int, required=True, help="this process carries the nodes i with i %% of == index")
    ap.add_argument("--of", type=int, required=True)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--rate", type=float, default=100.0, help="steps per second")
    ap.add_argument("--victim", default="")
    ap.add_argument("--epoch", type=float, default=0.0, help="time (Unix s) of step 0 of the shared step clock")
    ap.add_argument("--commit-every", type=int, default=1000, help="an abort holds the step floored to a multiple of this")
    ap.add_argument("--connect-timeout", type=float, default=120.0)
    ap.add_argument("--control", choices=("rank", "node"), default="rank", help="cluster.control: a connection per rank, or per node (a relay)")
    ap.add_argument("--watch", default="", help="record this simulated rank's control messages (heartbeats and metrics left out)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    EPOCH[0] = a.epoch or time.time()
    ranks = [Rank(f"sim{n}", j) for n in range(a.index, a.nodes, a.of) for j in range(a.wpn)]
    for r in ranks:
        r.watched = r.wid == a.watch
    res = asyncio.run(Sim(a, ranks).run())
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
