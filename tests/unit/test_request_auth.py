"""Request authentication (``RequestAuth``) of the non-envelope Swarm calls, through the
servicer: order NODE_UNKNOWN → AUTH_INVALID / AUTH_EXPIRED → NODE_BANNED → the rest."""

from __future__ import annotations

import gzip

import pytest

from ftis.coordinator.server.swarm_service import SwarmService
from ftis.lab.harness.coordinator import (
    FakeClock,
    FakeContext,
    make_coordinator,
    register,
    signed,
    tokenizer_fp,
    tokenizer_gz,
)
from ftis.protocol.errors import ErrorCode
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import swarm_pb2


@pytest.fixture
def world():
    clock = FakeClock()
    coord = make_coordinator(clock, register_clock_skew_s=300)
    node = register(coord, tokenizer_fp())
    return coord, SwarmService(coord.ctx), node, clock


def _requests(node_id: str) -> dict[str, object]:
    return {
        "Heartbeat": swarm_pb2.HeartbeatRequest(node_id=node_id, policy_version=2),
        "LeaseTasks": swarm_pb2.LeaseTasksRequest(
            node_id=node_id, count=1, group_size=2, max_new_tokens=16
        ),
        "PullBundles": swarm_pb2.PullBundlesRequest(node_id=node_id, max_bundles=4),
        "ReportMetrics": swarm_pb2.ReportMetricsRequest(node_id=node_id, step=1, values={"a": 1}),
        "UploadTokenizer": swarm_pb2.UploadTokenizerRequest(
            node_id=node_id, fingerprint=tokenizer_fp(), tokenizer_json_gz=tokenizer_gz()
        ),
    }


def _call(service: SwarmService, method: str, request) -> int:
    reply = getattr(service, method)(request, FakeContext())
    if isinstance(reply, bytes):  # a relay page goes out as wire bytes
        reply = swarm_pb2.PullBundlesResponse.FromString(reply)
    return reply.error.code


@pytest.mark.parametrize(
    "method", ["Heartbeat", "LeaseTasks", "PullBundles", "ReportMetrics", "UploadTokenizer"]
)
def test_signed_request_is_accepted_and_every_forgery_refused(world, method) -> None:
    coord, service, node, clock = world
    now = clock.now_ms

    def fresh():
        request = type(_requests(node.node_id)[method])()
        request.CopyFrom(_requests(node.node_id)[method])
        return request

    # not signed at all
    assert _call(service, method, fresh()) == ErrorCode.AUTH_INVALID
    # signed by another key
    assert _call(service, method, signed(fresh(), method, NodeIdentity.generate(), now)) == (
        ErrorCode.AUTH_INVALID
    )
    # a field altered after signing
    altered = signed(fresh(), method, node, now)
    if method == "UploadTokenizer":
        altered.tokenizer_json_gz = gzip.compress(b"{}")
    elif method == "ReportMetrics":
        altered.step = 2
    elif method == "Heartbeat":
        altered.policy_version = 3
    elif method == "PullBundles":
        altered.max_bundles = 5
    else:
        altered.count = 2
    assert _call(service, method, altered) == ErrorCode.AUTH_INVALID
    # a signature made for another method
    other = "Heartbeat" if method != "Heartbeat" else "LeaseTasks"
    assert _call(service, method, signed(fresh(), other, node, now)) == ErrorCode.AUTH_INVALID
    # timestamp outside the skew window (both directions); the timestamp is signed
    assert _call(service, method, signed(fresh(), method, node, now - 301_000)) == (
        ErrorCode.AUTH_EXPIRED
    )
    assert _call(service, method, signed(fresh(), method, node, now + 301_000)) == (
        ErrorCode.AUTH_EXPIRED
    )
    tampered_time = signed(fresh(), method, node, now - 1000)
    tampered_time.auth.timestamp_ms = now
    assert _call(service, method, tampered_time) == ErrorCode.AUTH_INVALID
    # correctly signed, within the window
    assert _call(service, method, signed(fresh(), method, node, now - 299_000)) == 0


def test_order_unknown_then_auth_then_banned(world) -> None:
    coord, service, node, clock = world
    stranger = NodeIdentity.generate()
    request = swarm_pb2.HeartbeatRequest(node_id=stranger.node_id)
    # unknown node: NODE_UNKNOWN whether signed or not
    assert _call(service, "Heartbeat", request) == ErrorCode.NODE_UNKNOWN
    assert _call(service, "Heartbeat", signed(request, "Heartbeat", stranger, clock.now_ms)) == (
        ErrorCode.NODE_UNKNOWN
    )
    coord.ban(node.node_id, "test")
    mine = swarm_pb2.HeartbeatRequest(node_id=node.node_id)
    # banned, but the request does not authenticate: the ban is not revealed
    assert _call(service, "Heartbeat", mine) == ErrorCode.AUTH_INVALID
    assert _call(service, "Heartbeat", signed(mine, "Heartbeat", node, 0)) == (
        ErrorCode.AUTH_EXPIRED
    )
    assert _call(service, "Heartbeat", signed(mine, "Heartbeat", node, clock.now_ms)) == (
        ErrorCode.NODE_BANNED
    )


def test_auth_comes_before_request_validation(world) -> None:
    _, service, node, clock = world
    bad = swarm_pb2.LeaseTasksRequest(node_id=node.node_id, count=0, group_size=2)
    assert _call(service, "LeaseTasks", bad) == ErrorCode.AUTH_INVALID
    assert _call(service, "LeaseTasks", signed(bad, "LeaseTasks", node, clock.now_ms)) == (
        ErrorCode.REQUEST_INVALID
    )


def test_heartbeat_reply_carries_own_reputation(world) -> None:
    coord, service, node, clock = world
    request = signed(
        swarm_pb2.HeartbeatRequest(node_id=node.node_id, policy_version=7),
        "Heartbeat",
        node,
        clock.now_ms,
    )
    reply = service.Heartbeat(request, FakeContext())
    assert reply.error.code == 0 and reply.server_time_ms == clock.now_ms
    assert reply.reputation == 0.5 and reply.quarantined is False
    coord.flush_seen()  # last-seen times are buffered and written in batches
    assert coord.state.get_node(node.node_id).policy_version == 7


def test_node_records_are_reused_for_a_second_and_bans_cut_through(world) -> None:
    """Authentication reuses a node's record for NODE_CACHE_S (no database read); a ban
    by this process is effective at once, one by another worker within a second."""
    coord, service, node, clock = world
    hb = swarm_pb2.HeartbeatRequest(node_id=node.node_id)
    assert _call(service, "Heartbeat", signed(hb, "Heartbeat", node, clock())) == 0
    reads = []
    real = coord.state.get_node
    coord.state.get_node = lambda node_id: reads.append(node_id) or real(node_id)
    for _ in range(3):
        assert _call(service, "Heartbeat", signed(hb, "Heartbeat", node, clock())) == 0
    assert reads == []  # served from the cache
    coord.state.set_ban(node.node_id, True, "by another worker")  # not through this process
    clock.advance(0.5)
    assert _call(service, "Heartbeat", signed(hb, "Heartbeat", node, clock())) == 0
    clock.advance(0.6)
    assert _call(service, "Heartbeat", signed(hb, "Heartbeat", node, clock())) == (
        ErrorCode.NODE_BANNED)
    assert reads == [node.node_id]
    coord.unban(node.node_id)
    assert _call(service, "Heartbeat", signed(hb, "Heartbeat", node, clock())) == 0
    coord.ban(node.node_id, "by this process")
    assert _call(service, "Heartbeat", signed(hb, "Heartbeat", node, clock())) == (
        ErrorCode.NODE_BANNED)
