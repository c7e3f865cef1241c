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

import time
from pathlib import Path

import grpc
import pytest

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.server.app import CoordinatorServer
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


@pytest.fixture
def server(tmp_path: Path):
    budget = {k: getattr(PRODUCTION, k) for k in (
        "connection_refusals_per_s", "connection_refusal_burst", "connection_delay_s",
        "heartbeats_per_minute")}
    assert set(budget) - {"connection_delay_s"} <= set(UNLIMITED_QUOTAS)
    srv = CoordinatorServer(make_config(db=str(tmp_path / "coord.db"), **budget))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


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
