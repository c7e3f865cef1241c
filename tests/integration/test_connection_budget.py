"""One connection that keeps being refused is slowed, before decoding, and nobody else
is (issue 13, "Beyond these classes"; threat model §4.16), over real gRPC against a real
coordinator with the production refusal budget (20 at once, 10 a second, 0.25 s delay).

The attacker sends unparseable bytes as SubmitBundle on its own connection; an honest
node sends signed Heartbeats on another. The attacker's first 20 are answered at once
with REQUEST_INVALID, every later one with RATE_LIMITED no sooner than the delay; the
honest node's Heartbeats stay OK and fast throughout, and its reputation is untouched.
A delayed answer lets the bucket refill (0.25 s = 2.5 tokens), so a sequential attacker
settles at about 10 decoded refusals and 4 delayed answers a second.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.server.app import CoordinatorServer, connection_budget
from ftis.lab.harness.coordinator import (
    UNLIMITED_QUOTAS,
    make_config,
    model_card,
    register_envelope,
    signed,
)
from ftis.protocol.errors import ErrorCode
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import swarm_pb2, swarm_pb2_grpc

PRODUCTION = CoordinatorConfig(db="sqlite://")


def _channel(address: str) -> grpc.Channel:
    """A channel on its own connection (channels of one process share one otherwise)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture(params=["aio-inline", "aio"])
def server(request: pytest.FixtureRequest, tmp_path: Path):
    """A coordinator with the production budget on the ``request.param`` listener
    (``swarm_server``; the grpc.aio ones, handlers inline and in the pool)."""
    budget = {k: getattr(PRODUCTION, k) for k in (
        "connection_refusals_per_s", "connection_refusal_burst", "connection_delay_s",
        "heartbeats_per_minute")}
    assert set(budget) - {"connection_delay_s"} <= set(UNLIMITED_QUOTAS)
    srv = CoordinatorServer(make_config(db=str(tmp_path / "coord.db"),
                                        swarm_server=request.param, **budget))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


@pytest.mark.parametrize("server", ["aio", "threads"], indirect=True)
def test_a_refused_connection_is_slowed_and_an_honest_one_is_not(server) -> None:
    assert (PRODUCTION.connection_refusal_burst, PRODUCTION.connection_refusals_per_s,
            PRODUCTION.connection_delay_s) == (20, 10, 0.25)
    honest_channel, attack_channel = _channel(server.address), _channel(server.address)
    stub = swarm_pb2_grpc.SwarmStub(honest_channel)
    garbage = attack_channel.unary_unary("/ftis.v1.Swarm/SubmitBundle",
                                         request_serializer=None,
                                         response_deserializer=None)
    honest = NodeIdentity.generate()
    now = int(time.time() * 1000)
    reply = stub.Register(swarm_pb2.RegisterRequest(
        envelope=register_envelope(honest, model_card(), now)))
    assert reply.error.code == 0

    def beat() -> tuple[int, float, float]:
        t0 = time.perf_counter()
        r = stub.Heartbeat(signed(swarm_pb2.HeartbeatRequest(node_id=honest.node_id),
                                  "Heartbeat", honest, int(time.time() * 1000)))
        return r.error.code, time.perf_counter() - t0, r.reputation

    code, _, reputation = beat()
    assert code == 0

    def attack() -> tuple[int, float]:
        t0 = time.perf_counter()
        r = swarm_pb2.SubmitBundleResponse.FromString(garbage(b"\xff" * 64))
        return r.error.code, time.perf_counter() - t0

    first = [attack() for _ in range(20)]
    assert [c for c, _ in first] == [ErrorCode.REQUEST_INVALID] * 20
    later, honest_beats = [], []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        later.append(attack())
        honest_beats.append(beat())
    elapsed = time.perf_counter() - t0
    codes = [c for c, _ in later]
    assert set(codes) == {ErrorCode.REQUEST_INVALID, ErrorCode.RATE_LIMITED}
    # beyond the burst, at most 10 refusals a second are decoded (+1 for rounding)...
    assert codes.count(ErrorCode.REQUEST_INVALID) <= 10 * elapsed + 1
    # ...and every other answer waited the delay
    assert min(s for c, s in later if c == ErrorCode.RATE_LIMITED) >= 0.24
    assert codes[0] == ErrorCode.RATE_LIMITED
    # the honest node on its own connection: answered at once, OK, reputation unchanged
    assert all(c == 0 for c, _, _ in honest_beats)
    assert max(s for _, s, _ in honest_beats) < 0.2
    assert honest_beats[-1][2] == pytest.approx(reputation, abs=1e-3)
    honest_channel.close()
    attack_channel.close()


class _Flood:
    """``inflight`` garbage SubmitBundle requests kept in flight on one connection (a
    finished one is replaced from its done-callback); records ``(done_at, code, s)``."""

    def __init__(self, channel: grpc.Channel, inflight: int) -> None:
        self.call = channel.unary_unary("/ftis.v1.Swarm/SubmitBundle",
                                        request_serializer=None, response_deserializer=None)
        self.inflight = inflight
        self.answers: list[tuple[float, int, float]] = []
        self.failures: list[str] = []
        self.stopping = False
        self._lock = threading.Lock()

    def start(self) -> None:
        for _ in range(self.inflight):
            self._send()

    def _send(self) -> None:
        sent = time.perf_counter()
        future = self.call.future(b"\xff" * 64, timeout=30)
        future.add_done_callback(lambda f: self._done(f, sent))

    def _done(self, future: grpc.Future, sent: float) -> None:
        now = time.perf_counter()
        try:
            code = swarm_pb2.SubmitBundleResponse.FromString(future.result()).error.code
            with self._lock:
                self.answers.append((now, code, now - sent))
        except grpc.RpcError as exc:  # the channel closing at the end
            if not self.stopping:
                self.failures.append(str(exc.code()))
        if not self.stopping:
            self._send()


@pytest.mark.parametrize("server", ["aio", "threads"], indirect=True)
def test_a_connection_with_64_requests_in_flight_is_bounded(server) -> None:
    """64 requests of garbage always in flight on one connection: both listeners let all
    of them wait (the event-loop server as coroutines, the thread-pool server in its 256
    delay threads, which are not its handler threads), each connection's delay growing
    with its waiting requests, so the attacker gets at most ``burst`` +
    ``refusals_per_s`` decoded refusals a second + 16 / ``delay_s`` = 64 late answers a
    second, and an honest node on its own connection keeps getting OK Heartbeats, fast.
    With the thread-pool server's old cap (half of its 32 threads waiting, the rest
    answered at once) the attacker got 8,393 answers in these 4 s instead of ~300."""
    config = server.config
    budget = connection_budget(config)
    assert budget.max_answers_per_s == 64.0
    assert budget.max_delayed == (256 if config.swarm_server == "threads" else None)
    honest_channel, attack_channel = _channel(server.address), _channel(server.address)
    stub = swarm_pb2_grpc.SwarmStub(honest_channel)
    honest = NodeIdentity.generate()
    reply = stub.Register(swarm_pb2.RegisterRequest(
        envelope=register_envelope(honest, model_card(), int(time.time() * 1000))))
    assert reply.error.code == 0

    flood = _Flood(attack_channel, 64)
    seconds = 4.0
    t0 = time.perf_counter()
    flood.start()
    beats: list[tuple[int, float]] = []
    while time.perf_counter() - t0 < seconds:
        b0 = time.perf_counter()
        r = stub.Heartbeat(signed(swarm_pb2.HeartbeatRequest(node_id=honest.node_id),
                                  "Heartbeat", honest, int(time.time() * 1000)), timeout=10)
        beats.append((r.error.code, time.perf_counter() - b0))
        time.sleep(0.2)  # 20 beats in 4 s: inside the production 60/minute burst
    t1 = time.perf_counter()
    flood.stopping = True
    answers = [(at, code, s) for at, code, s in flood.answers if at <= t1]
    attack_channel.close()

    assert flood.failures == []
    codes = [code for _, code, _ in answers]
    assert set(codes) == {ErrorCode.REQUEST_INVALID, ErrorCode.RATE_LIMITED}
    elapsed = t1 - t0
    # decoded refusals: the burst, then as the bucket refills (the check and the take
    # happen in one step of the event loop, so none slips through)
    decoded_bound = config.connection_refusal_burst + config.connection_refusals_per_s * elapsed
    # on the thread-pool server the check and the take are two steps, so requests that
    # passed the check together may all be decoded: at most one per handler thread
    slack = config.swarm_handler_threads if config.swarm_server == "threads" else 1
    assert codes.count(ErrorCode.REQUEST_INVALID) <= decoded_bound + slack
    # late answers: 64 a second once all wait, plus the first wave of 44 that waited
    # 0.25 s up to 0.25 × 44/16 s on their way to the steady state
    late_bound = budget.max_answers_per_s * elapsed + 64
    assert codes.count(ErrorCode.RATE_LIMITED) <= late_bound
    # in the steady state the waits grew well past delay_s (63 or 64 waiting: ~1 s)
    steady = sorted(s for at, code, s in answers
                    if code == ErrorCode.RATE_LIMITED and at > t0 + 2.0)
    assert steady and steady[len(steady) // 2] >= 0.75
    # the honest node on its own connection: every Heartbeat OK, none slow
    assert len(beats) >= 10 and all(code == 0 for code, _ in beats)
    assert max(s for _, s in beats) < 0.5, beats
    honest_channel.close()


@pytest.mark.parametrize("listener", ["aio-inline", "aio", "threads"])
def test_many_connections_of_one_host_share_the_hosts_budget(
        listener: str, tmp_path: Path) -> None:
    """An attacker that spreads its refusals over many connections (each starts with a
    full bucket of 20; reconnecting gets a new one) is bounded by its host's budget (100
    at once, 50 a second). Over real gRPC, with loopback not exempt so that this machine
    is the attacker's host: 10 connections send 20 unparseable requests each, all at
    once. The connections' own budgets would let all 200 be decoded; at most
    100 + 50·t are, the rest answered RATE_LIMITED undecoded."""
    assert (PRODUCTION.host_refusal_burst, PRODUCTION.host_refusals_per_s) == (100, 50)
    budget = {k: getattr(PRODUCTION, k) for k in (
        "connection_refusals_per_s", "connection_refusal_burst", "connection_delay_s",
        "host_refusals_per_s", "host_refusal_burst")}
    srv = CoordinatorServer(make_config(db=str(tmp_path / "coord.db"), swarm_server=listener,
                                        host_refusal_exempt=[], **budget))
    srv.start()
    channels = [_channel(srv.address) for _ in range(10)]
    try:
        calls = [c.unary_unary("/ftis.v1.Swarm/SubmitBundle", request_serializer=None,
                               response_deserializer=None) for c in channels]
        for call in calls:  # connect every channel first (one decoded refusal each)
            assert swarm_pb2.SubmitBundleResponse.FromString(
                call(b"\xff" * 8, timeout=10)).error.code == ErrorCode.REQUEST_INVALID
        t0 = time.perf_counter()
        futures = [call.future(b"\xff" * 8, timeout=30) for call in calls for _ in range(19)]
        codes = [swarm_pb2.SubmitBundleResponse.FromString(f.result()).error.code
                 for f in futures]
        elapsed = time.perf_counter() - t0
    finally:
        for channel in channels:
            channel.close()
        srv.stop(grace=1.0)
    decoded = 10 + codes.count(ErrorCode.REQUEST_INVALID)
    late = codes.count(ErrorCode.RATE_LIMITED)
    assert decoded + late == 200
    assert decoded <= 100 + 50 * elapsed + 1, (decoded, elapsed)
    assert late >= 40, (decoded, late, elapsed)
