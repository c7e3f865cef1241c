"""Quotas: token buckets, per-node bundle/byte/pull limits, registration throttling of
new node ids, request size limits checked before decoding, and the config surface."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ftis.coordinator.cli.main import parse_overrides
from ftis.coordinator.config import CoordinatorConfig, load_config
from ftis.coordinator.quotas import ConnectionBudget, RateLimiter, peer_host
from ftis.coordinator.server.app import connection_budget
from ftis.coordinator.server.swarm_service import SwarmService, _refusing, _refusing_async
from ftis.lab.harness.coordinator import (
    FakeClock,
    FakeContext,
    build_bundle,
    make_config,
    make_coordinator,
    model_card,
    register,
    register_envelope,
    seal_bundle,
    signed,
    snapshot,
)
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import swarm_pb2


class Seconds:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_burst_and_refill() -> None:
    clock = Seconds()
    limiter = RateLimiter(6, period_s=60, clock=clock)
    assert [limiter.try_take("a") for _ in range(7)] == [True] * 6 + [False]
    assert limiter.try_take("b")  # keys are independent
    clock.now += 10  # 6 per minute = one every 10 s
    assert limiter.try_take("a") and not limiter.try_take("a")
    clock.now += 3600
    assert limiter.available("a") == 6  # never above capacity
    assert limiter.try_take("a", 100)  # larger than capacity: clamped, needs a full bucket
    assert not limiter.try_take("a")


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.1.2.3:5555", "10.1.2.3"),
        ("ipv6:[2001:db8:1:2:3:4:5:6]:443", "2001:db8:1:2::/64"),
        ("ipv6:[::ffff:10.0.0.1]:80", "10.0.0.1"),
        ("unix:/tmp/socket", "unix"),
        ("", ""),
    ],
)
def test_peer_host_strips_the_port(peer, host) -> None:
    assert peer_host(peer) == host


def _code(fn, *args) -> int:
    with pytest.raises(FtisError) as info:
        fn(*args)
    return info.value.code


def _submitter(bundles: int, **config):  # noqa: ANN003, ANN202
    """A coordinator on a fake clock with ``config``, one registered node and sealed
    bundles answering ``bundles`` of its leases: ``(clock, coord, node, envelopes)``."""
    clock = FakeClock()
    coord = make_coordinator(clock, **config)
    node = register(coord)
    leases = coord.lease_tasks(node.node_id, bundles, 2, 16)
    return clock, coord, node, [seal_bundle(build_bundle(x, node), node) for x in leases]


def test_bundles_per_minute(monkeypatch) -> None:
    clock, coord, node, envelopes = _submitter(4, bundles_per_minute=2)
    coord.submit_bundle(envelopes[0])
    coord.submit_bundle(envelopes[1])
    before = snapshot(coord)
    # counted in the database (verdicts of the last minute), so every worker sees it
    assert _code(coord.submit_bundle, envelopes[2]) == ErrorCode.RATE_LIMITED
    assert snapshot(coord) == before
    assert coord.evidence(node.node_id)[0].kind == "rate_limited"
    assert coord.evidence(node.node_id)[0].weight == -0.5
    assert coord.state.rejections_by_code(node.node_id) == {ErrorCode.RATE_LIMITED: 1}
    clock.advance(30)  # a sliding one-minute window: both bundles still count
    assert _code(coord.submit_bundle, envelopes[2]) == ErrorCode.RATE_LIMITED
    clock.advance(31)
    coord.submit_bundle(envelopes[2])
    other = register(coord)  # per node
    (lease,) = coord.lease_tasks(other.node_id, 1, 2, 16)
    coord.submit_bundle(seal_bundle(build_bundle(lease, other), other))


def test_bundle_bytes_per_minute() -> None:
    clock = FakeClock()
    coord = make_coordinator(clock, bundle_bytes_per_minute=4096)
    node = register(coord)
    leases = coord.lease_tasks(node.node_id, 3, 2, 256)
    big = [seal_bundle(build_bundle(x, node, n_tokens=120), node) for x in leases]
    assert 1500 < big[0].ByteSize() < 2048
    coord.submit_bundle(big[0])
    coord.submit_bundle(big[1])
    assert _code(coord.submit_bundle, big[2]) == ErrorCode.RATE_LIMITED


def test_unknown_sender_is_not_rate_limited_but_unknown() -> None:
    coord = make_coordinator(FakeClock(), bundles_per_minute=1)
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    stranger = NodeIdentity.generate()
    for _ in range(3):
        envelope = seal_bundle(build_bundle(lease, stranger), stranger)
        assert _code(coord.submit_bundle, envelope) == ErrorCode.NODE_UNKNOWN
    coord.submit_bundle(seal_bundle(build_bundle(lease, node), node))


def test_pulls_per_minute() -> None:
    clock = FakeClock()
    coord = make_coordinator(clock, pulls_per_minute=3)
    node = register(coord)
    for _ in range(3):
        coord.pull_bundles(node.node_id, 0, 8)
    assert _code(coord.pull_bundles, node.node_id, 0, 8) == ErrorCode.RATE_LIMITED
    clock.advance(20)
    coord.pull_bundles(node.node_id, 0, 8)


def test_relay_bytes_per_minute_cut_pages_then_refuse() -> None:
    """``pull_bytes_per_minute`` bounds the envelope bytes served to a node: a page is
    cut to the bytes left (at least one bundle), then the node is refused RATE_LIMITED
    until the bucket refills; another node has its own."""
    clock = FakeClock()
    coord = make_coordinator(clock, pull_bytes_per_minute=1 << 20)
    sender, reader, other = register(coord), register(coord), register(coord)
    leases = coord.lease_tasks(sender.node_id, 8, 2, 256)
    for lease in leases:
        coord.submit_bundle(seal_bundle(build_bundle(lease, sender, n_tokens=120), sender))
    sizes = [b.size_bytes for b in coord.state.pull_bundles(
        requester_id=other.node_id, cursor=0, limit=8, max_bytes=1 << 30)[0]]
    assert len(sizes) == 8 and all(1500 < n < 4096 for n in sizes)
    left = sizes[0] + sizes[1] + sizes[2] // 2
    coord.ctx.quotas.charge_pull_bytes(reader.node_id, (1 << 20) - left)
    page, cursor = coord.pull_bundles(reader.node_id, 0, 8)  # 2.5 bundles' bytes: 2 fit
    assert len(page) == 2
    page, cursor = coord.pull_bundles(reader.node_id, cursor, 8)  # half of one: one
    assert len(page) == 1
    assert _code(coord.pull_bundles, reader.node_id, cursor, 8) == ErrorCode.RATE_LIMITED
    assert len(coord.pull_bundles(other.node_id, 0, 8)[0]) == 8
    clock.advance(60 * (sizes[3] + sizes[4] + sizes[5] + sizes[6] // 2) / (1 << 20))
    assert len(coord.pull_bundles(reader.node_id, cursor, 8)[0]) == 3


def _register_via(service: SwarmService, identity: NodeIdentity, peer: str, now: int) -> int:
    request = swarm_pb2.RegisterRequest(envelope=register_envelope(identity, model_card(), now))
    return service.Register(request, FakeContext(peer)).error.code


def test_registration_throttling_of_new_node_ids() -> None:
    clock = FakeClock()
    coord = make_coordinator(clock, registrations_per_minute=5, registrations_per_host_per_minute=2)
    service = SwarmService(coord.ctx)
    known = NodeIdentity.generate()
    assert _register_via(service, known, "ipv4:10.0.0.1:1000", clock.now_ms) == 0
    assert _register_via(service, NodeIdentity.generate(), "ipv4:10.0.0.1:1001", clock.now_ms) == 0
    # third new id from the same host (any port) in a minute
    assert _register_via(service, NodeIdentity.generate(), "ipv4:10.0.0.1:1002", clock.now_ms) == (
        ErrorCode.REGISTRATION_THROTTLED
    )
    # re-registration of a known node is never throttled
    for _ in range(5):
        assert _register_via(service, known, "ipv4:10.0.0.1:1003", clock.now_ms) == 0
    # other hosts until the global limit (5 new ids per minute)
    for host in ("10.0.0.2", "10.0.0.3", "10.0.0.4"):
        assert _register_via(service, NodeIdentity.generate(), f"ipv4:{host}:9", clock.now_ms) == 0
    assert _register_via(service, NodeIdentity.generate(), "ipv4:10.0.0.5:9", clock.now_ms) == (
        ErrorCode.REGISTRATION_THROTTLED
    )
    assert len(coord.state.list_nodes()) == 5
    clock.advance(30)  # 2.5 global and 1 per-host tokens back
    assert _register_via(service, NodeIdentity.generate(), "ipv4:10.0.0.1:9", clock.now_ms) == 0


#: The thread-pool server's handler threads, for :func:`_refusing` called directly.
HANDLING = threading.BoundedSemaphore(4)


def _budget(clock: FakeClock | None = None, **kw) -> ConnectionBudget:
    settings: dict = dict(refusals_per_s=10.0, burst=20.0, delay_s=0.0, max_delayed=2)
    settings.update(kw)
    seconds = (lambda: clock.now_ms / 1000.0) if clock is not None else (lambda: 0.0)
    return ConnectionBudget(clock=seconds, **settings)  # type: ignore[arg-type]


def _never_called(request, context):
    pytest.fail("decoded and handled")


def test_request_size_is_checked_before_decoding() -> None:
    handler = _refusing(lambda r, c: swarm_pb2.HeartbeatResponse(server_time_ms=len(r.node_id)),
                        swarm_pb2.HeartbeatRequest, swarm_pb2.HeartbeatResponse, "X", 64,
                        _budget(), HANDLING)
    small = swarm_pb2.HeartbeatRequest(node_id="a" * 10).SerializeToString()
    assert handler(small, FakeContext()).server_time_ms == 10
    refuse = _refusing(_never_called, swarm_pb2.HeartbeatRequest, swarm_pb2.HeartbeatResponse,
                       "X", 64, _budget(), HANDLING)
    reply = refuse(b"\xff" * 65, FakeContext())  # would not even parse
    assert reply.error.code == ErrorCode.REQUEST_TOO_LARGE and "65" in reply.error.reason


def test_undecodable_requests_are_refused_in_band_without_a_traceback(caplog) -> None:
    """Bytes that do not parse get REQUEST_INVALID from the handler (no handler work),
    not gRPC's INTERNAL with a logged traceback per request."""
    handler = _refusing(_never_called, swarm_pb2.HeartbeatRequest, swarm_pb2.HeartbeatResponse,
                        "Heartbeat", 1 << 20, _budget(), HANDLING)
    with caplog.at_level("DEBUG"):
        reply = handler(b"\xff" * 40, None)
    assert reply.error.code == ErrorCode.REQUEST_INVALID
    assert reply.error.reason == "40 bytes that do not decode as a Heartbeat request"
    assert not [r for r in caplog.records if r.exc_info]


def test_a_connection_over_its_refusal_budget_is_answered_undecoded() -> None:
    """20 refusals at once are allowed; the 21st request of that connection is answered
    RATE_LIMITED without being decoded; another connection is untouched; half a second
    later (10 refusals/s → 5 back) the connection is served again."""
    clock = FakeClock()
    budget = _budget(clock)
    served: list[str] = []

    def behavior(request, context):
        served.append(request.node_id)
        return swarm_pb2.HeartbeatResponse()

    handler = _refusing(behavior, swarm_pb2.HeartbeatRequest, swarm_pb2.HeartbeatResponse,
                        "Heartbeat", 1 << 20, budget, HANDLING)
    attacker, honest = FakeContext("ipv4:10.0.0.9:4000"), FakeContext("ipv4:10.0.0.9:4001")
    codes = [handler(b"\xff" * 8, attacker).error.code for _ in range(20)]
    assert codes == [ErrorCode.REQUEST_INVALID] * 20
    good = swarm_pb2.HeartbeatRequest(node_id="n").SerializeToString()
    reply = handler(good, attacker)
    assert reply.error.code == ErrorCode.RATE_LIMITED and served == []
    assert "10 times per second" in reply.error.reason
    # answers over budget are not refusals of their own: the bucket refills
    for _ in range(50):
        assert handler(good, attacker).error.code == ErrorCode.RATE_LIMITED
    assert budget.answered_over_budget == 51
    assert handler(good, honest).error.code == 0 and served == ["n"]
    clock.advance(0.5)
    assert handler(good, attacker).error.code == 0 and served == ["n", "n"]


def test_refusals_the_coordinator_causes_are_not_counted() -> None:
    budget = _budget()
    for _ in range(100):
        budget.record_refusal("c", ErrorCode.VERIFICATION_BUSY)
        budget.record_refusal("c", ErrorCode.INTERNAL)
        budget.record_refusal("c", 0)
    assert not budget.over_budget("c")
    for _ in range(20):
        budget.record_refusal("c", ErrorCode.RATE_LIMITED)
    assert budget.over_budget("c")


def test_delays_are_bounded_in_number_when_they_hold_threads() -> None:
    """The thread-pool server's budget: at most ``max_delayed`` requests wait at once;
    beyond that they are answered at once (delay 0), and a finished delay frees its
    slot."""
    budget = _budget(delay_s=0.25, max_delayed=2)
    first, second, third = (budget.start_delay("a"), budget.start_delay("b"),
                            budget.start_delay("a"))
    assert (first, second, third) == (0.25, 0.25, 0.0)
    budget.end_delay("a", third)
    assert budget.start_delay("c") == 0.0
    budget.end_delay("a", first)
    assert budget.start_delay("c") == 0.25
    assert budget.answered_over_budget == 5
    for bad in (dict(refusals_per_s=0), dict(max_delayed=0), dict(waiting_per_delay=0),
                dict(delay_s=-1)):
        with pytest.raises(ValueError):
            _budget(**bad)


def test_the_delay_grows_with_the_connections_requests_waiting() -> None:
    """No cap on how many wait (``max_delayed=None``, the event-loop server); the delay
    is ``delay_s × max(1, w / 16)`` for ``w`` requests of that connection waiting, this
    one included: 0.25 s up to 16, 0.25 × 17/16 = 0.265625 s for the 17th, 0.5 s for the
    32nd, 1.0 s for the 64th. Another connection waits 0.25 s; finished delays shrink
    the count again."""
    budget = _budget(delay_s=0.25, max_delayed=None)
    assert budget.max_delayed is None and budget.waiting_per_delay == 16
    delays = [budget.start_delay("attacker") for _ in range(64)]
    assert delays[:16] == [0.25] * 16
    assert delays[16] == 0.265625
    assert delays[31] == 0.5
    assert delays[63] == 1.0
    assert budget.waiting("attacker") == 64
    assert budget.start_delay("other") == 0.25
    for delay in delays[32:]:
        budget.end_delay("attacker", delay)
    assert budget.waiting("attacker") == 32
    assert budget.start_delay("attacker") == 0.25 * 33 / 16  # 0.515625
    budget.end_delay("other", 0.25)
    assert budget.waiting("other") == 0 and "other" not in budget._waiting
    assert budget.answered_over_budget == 66


def test_answers_over_budget_per_second_are_bounded_per_connection() -> None:
    """``k`` requests in flight, all waiting: ``k`` answers every ``delay_for(k)``
    seconds, i.e. ``min(k / 0.25, 16 / 0.25)`` = 4, 32, 64, 64, 64 a second for k = 1,
    8, 16, 64, 1024: never more than ``max_answers_per_s`` = 64."""
    budget = _budget(delay_s=0.25, max_delayed=None)
    rates = [k / budget.delay_for(k) for k in (1, 8, 16, 64, 1024)]
    assert rates == [4.0, 32.0, 64.0, 64.0, 64.0]
    assert budget.max_answers_per_s == 64.0
    assert _budget(delay_s=0.5, waiting_per_delay=8).max_answers_per_s == 16.0
    assert _budget(delay_s=0.0).max_answers_per_s == float("inf")
    assert _budget(delay_s=0.0).start_delay("a") == 0.0  # nothing to wait for or count


def test_the_event_loop_handler_checks_before_its_thread_hop() -> None:
    """The ``grpc.aio`` handler refuses over budget, too large and undecodable requests
    in the event loop; only a decoded request goes to the executor, with a ``Caller``
    that carries the connection."""
    clock = FakeClock()
    budget = _budget(clock)
    hops: list[str] = []

    class Recording(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
            hops.append(fn.__name__)
            return super().submit(fn, *args, **kwargs)

    def behavior(request, caller):
        return swarm_pb2.HeartbeatResponse(server_time_ms=len(caller.peer()))

    with Recording(2) as executor:
        handler = _refusing_async(behavior, swarm_pb2.HeartbeatRequest,
                                  swarm_pb2.HeartbeatResponse, "Heartbeat", 64, budget,
                                  executor)
        attacker = FakeContext("ipv4:10.0.0.9:4000")
        good = swarm_pb2.HeartbeatRequest(node_id="n").SerializeToString()

        async def calls() -> list[int]:
            codes = [(await handler(b"\xff" * 8, attacker)).error.code for _ in range(10)]
            codes += [(await handler(b"\x00" * 65, attacker)).error.code for _ in range(10)]
            codes.append((await handler(good, attacker)).error.code)  # over budget
            ok = await handler(good, FakeContext("ipv4:10.0.0.9:4001"))
            codes.append(ok.error.code)
            assert ok.server_time_ms == len("ipv4:10.0.0.9:4001")
            return codes

        codes = asyncio.run(calls())
    assert codes == ([ErrorCode.REQUEST_INVALID] * 10 + [ErrorCode.REQUEST_TOO_LARGE] * 10
                     + [ErrorCode.RATE_LIMITED, 0])
    assert hops == ["behavior"]


def test_heartbeats_have_a_quota() -> None:
    """60 heartbeats per minute per node by default: the 61st at once is RATE_LIMITED,
    another node is not, and one second later one more is allowed."""
    clock = FakeClock()
    coord = make_coordinator(clock, heartbeats_per_minute=60)
    a, b = register(coord), register(coord)
    service = SwarmService(coord.ctx)

    def beat(ident: NodeIdentity) -> int:
        request = signed(swarm_pb2.HeartbeatRequest(node_id=ident.node_id), "Heartbeat",
                         ident, clock.now_ms)
        return service.Heartbeat(request, None).error.code

    assert [beat(a) for _ in range(60)] == [0] * 60
    assert beat(a) == ErrorCode.RATE_LIMITED
    assert beat(b) == 0
    clock.advance(1)
    assert beat(a) == 0


def test_limits_in_config_env_and_cli(monkeypatch, tmp_path) -> None:
    cfg = CoordinatorConfig(db="sqlite://")
    assert (cfg.bundles_per_minute, cfg.pulls_per_minute) == (120, 600)
    assert cfg.bundle_bytes_per_minute == 64 << 20
    assert (cfg.registrations_per_minute, cfg.registrations_per_host_per_minute) == (30, 10)
    assert cfg.max_tokenizer_gz_bytes == 32 << 20 and cfg.max_tokenizer_json_bytes == 64 << 20
    assert cfg.require_tokenizer is True
    limits = cfg.method_request_limits
    assert limits["Heartbeat"] == 1 << 20 and limits["UploadTokenizer"] > 32 << 20
    assert cfg.grpc_max_receive_bytes == limits["UploadTokenizer"]
    monkeypatch.setenv("FTIS_COORDINATOR_PULLS_PER_MINUTE", "42")
    monkeypatch.setenv("FTIS_COORDINATOR_REPUTATION", json.dumps({"half_life_s": 60}))
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"bundles_per_minute": 7, "require_tokenizer": False}))
    overrides = parse_overrides(["registrations_per_minute=3", "reputation.half_life_s=90"])
    loaded = load_config(path, **overrides)
    assert (loaded.pulls_per_minute, loaded.bundles_per_minute) == (42, 7)
    assert loaded.registrations_per_minute == 3 and loaded.reputation.half_life_s == 90
    assert loaded.require_tokenizer is False
    with pytest.raises(ValueError):
        parse_overrides(["no-equals-sign"])
    with pytest.raises(ValueError):
        make_config(bundles_per_minute=0)


def test_a_sender_over_its_quota_is_refused_from_memory_for_a_moment() -> None:
    """After one recorded RATE_LIMITED, the sender's next submissions within
    REFUSAL_HOLD_MS are refused without a database read or write (no verdict row, no
    evidence); then the database decides again."""
    from ftis.coordinator.handlers.context import REFUSAL_HOLD_MS

    clock, coord, node, envelopes = _submitter(3, bundles_per_minute=1)
    coord.submit_bundle(envelopes[0])
    assert _code(coord.submit_bundle, envelopes[1]) == ErrorCode.RATE_LIMITED
    recorded = coord.state.rejections_by_code(node.node_id)
    evidence = len(coord.evidence(node.node_id))
    for _ in range(5):  # held: refused, nothing written
        assert _code(coord.submit_bundle, envelopes[2]) == ErrorCode.RATE_LIMITED
    assert coord.state.rejections_by_code(node.node_id) == recorded == {
        ErrorCode.RATE_LIMITED: 1}
    assert len(coord.evidence(node.node_id)) == evidence
    assert coord.ctx.refusals.refused == 5
    clock.advance(REFUSAL_HOLD_MS / 1000)  # the hold is over: recorded again
    assert _code(coord.submit_bundle, envelopes[2]) == ErrorCode.RATE_LIMITED
    assert coord.state.rejections_by_code(node.node_id) == {ErrorCode.RATE_LIMITED: 2}
    clock.advance(61)  # the window moved: accepted
    coord.submit_bundle(envelopes[2])
    # another node is not held
    other = register(coord)
    (lease,) = coord.lease_tasks(other.node_id, 1, 2, 16)
    coord.submit_bundle(seal_bundle(build_bundle(lease, other), other))


def test_unattributable_refusals_write_at_most_their_budget_of_verdict_rows() -> None:
    from ftis.coordinator.quotas import UNATTRIBUTED_VERDICTS_PER_S

    clock = FakeClock()
    coord = make_coordinator(clock)
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    bad = seal_bundle(build_bundle(lease, node), node)
    bad.signature = bytes([bad.signature[0] ^ 1]) + bad.signature[1:]
    for _ in range(50):  # all at the same instant
        assert _code(coord.submit_bundle, bad) == ErrorCode.SIGNATURE_INVALID
    budget = int(UNATTRIBUTED_VERDICTS_PER_S)
    assert coord.state.rejections_by_code() == {ErrorCode.SIGNATURE_INVALID: budget}
    assert coord.ctx.quotas.unattributed_dropped == 50 - budget
    clock.advance(1.0)  # refilled: recorded again
    assert _code(coord.submit_bundle, bad) == ErrorCode.SIGNATURE_INVALID
    assert coord.state.rejections_by_code() == {ErrorCode.SIGNATURE_INVALID: budget + 1}


def test_the_listener_is_chosen_in_config() -> None:
    assert CoordinatorConfig(db="sqlite://").swarm_server == "aio-inline"  # the default
    threads = CoordinatorConfig(db="sqlite://", swarm_server="threads",
                                swarm_handler_threads=8, swarm_delay_threads=40)
    assert connection_budget(threads).max_delayed == 40  # the delay threads, not half
    assert connection_budget(CoordinatorConfig(db="sqlite://", swarm_server="threads")
                             ).max_delayed == 256
    for listener in ("aio", "aio-inline"):  # waiting requests are coroutines: no cap
        aio = CoordinatorConfig(db="sqlite://", swarm_server=listener)
        assert connection_budget(aio).max_delayed is None
    with pytest.raises(ValueError):
        CoordinatorConfig(db="sqlite://", swarm_server="processes")


def test_reconnecting_does_not_refill_the_hosts_budget() -> None:
    """Host budget 100 at once, 50/s. An attacker opening a new connection after every
    20 refusals spends its host's 100 in 5 connections; the 6th fresh connection of that
    host is answered late at once, keyed by the host; another host and loopback are
    untouched; 1 s later 50 refusals are back."""
    clock = FakeClock()
    budget = _budget(clock, host_refusals_per_s=50.0, host_burst=100.0)
    for port in range(5):
        conn = f"ipv4:203.0.113.7:{4000 + port}"
        for _ in range(20):
            assert budget.limited_key(conn) is None
            budget.record_refusal(conn, ErrorCode.REQUEST_INVALID)
        # its own bucket is empty first; after the 5th connection, the host's too
        assert budget.limited_key(conn) == (conn if port < 4 else "203.0.113.7")
    fresh = "ipv4:203.0.113.7:4005"
    assert budget.limited_key(fresh) == "203.0.113.7" and budget.over_budget(fresh)
    assert budget.limited_key("ipv4:203.0.113.8:4000") is None
    # loopback is exempt by default: 200 refusals over 10 connections, each its own budget
    for port in range(10):
        for _ in range(20):
            budget.record_refusal(f"ipv4:127.0.0.1:{port}", ErrorCode.REQUEST_INVALID)
    assert budget.limited_key("ipv4:127.0.0.1:99") is None
    assert budget.limited_key("ipv4:127.0.0.1:0") == "ipv4:127.0.0.1:0"
    clock.advance(1.0)
    assert budget.limited_key(fresh) is None
    # an IPv6 /64 is one host
    for i in range(100):
        budget.record_refusal(f"ipv6:[2001:db8::{i:x}]:4000", ErrorCode.REQUEST_INVALID)
    assert budget.limited_key("ipv6:[2001:db8::ffff]:1") == "2001:db8::/64"
    assert budget.limited_key("ipv6:[2001:db8:0:1::1]:1") is None


def test_a_hosts_late_answers_share_one_waiting_count() -> None:
    """Over the host's budget, the delay grows with the host's waiting requests, whatever
    connection they came on: the 32nd waits 0.25 × 32 / 16 = 0.5 s."""
    budget = _budget(host_refusals_per_s=1.0, host_burst=1.0, delay_s=0.25, max_delayed=None)
    budget.record_refusal("ipv4:198.51.100.1:1", ErrorCode.REQUEST_INVALID)
    keys = [budget.limited_key(f"ipv4:198.51.100.1:{port}") for port in range(2, 34)]
    assert set(keys) == {"198.51.100.1"}
    delays = [budget.start_delay(key) for key in keys if key is not None]
    assert delays[0] == 0.25 and delays[15] == 0.25 and delays[31] == pytest.approx(0.5)
    assert budget.waiting("198.51.100.1") == 32
    for key, delay in zip(keys, delays, strict=True):
        budget.end_delay(key or "", delay)
    assert budget.waiting("198.51.100.1") == 0


def test_host_budget_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="both"):
        ConnectionBudget(refusals_per_s=1, burst=1, delay_s=0, host_refusals_per_s=1.0)
    with pytest.raises(ValueError, match="both"):
        ConnectionBudget(refusals_per_s=1, burst=1, delay_s=0, host_refusals_per_s=0.0,
                         host_burst=1.0)
    config = CoordinatorConfig()
    assert (config.host_refusals_per_s, config.host_refusal_burst) == (50, 100)
    assert config.host_refusal_exempt == ["127.0.0.0/8", "::1/128"]
    with pytest.raises(ValueError, match="not a network"):
        CoordinatorConfig(host_refusal_exempt=["localhost"])
    budget = connection_budget(CoordinatorConfig(host_refusal_exempt=[]))
    assert budget.host_refusals is not None and budget.host_refusals.capacity == 100
    for _ in range(100):
        budget.record_refusal(f"ipv4:127.0.0.1:{_}", ErrorCode.REQUEST_INVALID)
    assert budget.limited_key("ipv4:127.0.0.1:5000") == "127.0.0.1"


def test_one_connection_is_handled_at_most_max_handling_at_a_time() -> None:
    """A connection with 3 requests being handled (``max_handling`` 3) gets RATE_LIMITED
    at once for a 4th, undecoded, and that refusal counts against its budget; another
    connection is handled meanwhile; once one of the 3 is answered the connection is
    handled again. On the thread-pool listener this keeps one connection from holding
    every handler thread (its relay pages then queue everyone's requests)."""
    budget = _budget(max_handling=3)
    inside, release = threading.Semaphore(0), threading.Event()

    def behavior(request, context):
        inside.release()
        if request.node_id == "slow":
            assert release.wait(10)
        return swarm_pb2.HeartbeatResponse(server_time_ms=1)

    handler = _refusing(behavior, swarm_pb2.HeartbeatRequest, swarm_pb2.HeartbeatResponse,
                        "Heartbeat", 1 << 20, budget, threading.BoundedSemaphore(32))
    slow = swarm_pb2.HeartbeatRequest(node_id="slow").SerializeToString()
    fast = swarm_pb2.HeartbeatRequest(node_id="fast").SerializeToString()
    attacker, other = FakeContext("ipv4:10.0.0.9:4000"), FakeContext("ipv4:10.0.0.7:4000")
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(handler, slow, attacker) for _ in range(3)]
        for _ in range(3):
            assert inside.acquire(timeout=10)
        assert budget.handling("ipv4:10.0.0.9:4000") == 3
        available = budget.refusals.available("ipv4:10.0.0.9:4000")
        reply = handler(fast, attacker)
        assert reply.error.code == ErrorCode.RATE_LIMITED
        assert "more than 3 requests of this connection" in reply.error.reason
        assert budget.refusals.available("ipv4:10.0.0.9:4000") == available - 1
        assert handler(fast, other).server_time_ms == 1  # another connection: handled
        release.set()
        assert [f.result(timeout=10).server_time_ms for f in held] == [1, 1, 1]
    assert budget.handling("ipv4:10.0.0.9:4000") == 0
    assert handler(fast, attacker).server_time_ms == 1
    with pytest.raises(ValueError):
        _budget(max_handling=0)


def test_the_async_handler_caps_a_connections_requests_being_handled() -> None:
    """The event-loop listener applies the same cap before its thread hop."""
    budget = _budget(max_handling=1)
    release = threading.Event()

    def behavior(request, context):
        assert release.wait(10)
        return swarm_pb2.HeartbeatResponse(server_time_ms=1)

    good = swarm_pb2.HeartbeatRequest(node_id="n").SerializeToString()

    async def run() -> list[int]:
        with ThreadPoolExecutor(2) as pool:
            handler = _refusing_async(behavior, swarm_pb2.HeartbeatRequest,
                                      swarm_pb2.HeartbeatResponse, "Heartbeat", 1 << 20,
                                      budget, pool)
            first = asyncio.ensure_future(handler(good, FakeContext("ipv4:10.0.0.9:4000")))
            await asyncio.sleep(0.05)
            second = await handler(good, FakeContext("ipv4:10.0.0.9:4000"))
            release.set()
            return [(await first).server_time_ms, second.error.code]

    assert asyncio.run(run()) == [1, ErrorCode.RATE_LIMITED]


def test_one_relay_page_at_a_time_per_node() -> None:
    """A second pull of a node while its first is served is refused (RATE_LIMITED),
    costs none of its pull quota, and another node is served meanwhile."""
    clock = FakeClock()
    coord = make_coordinator(clock, pulls_per_minute=2)
    node, other = register(coord), register(coord)
    assert coord.ctx.quotas.start_pull(node.node_id)  # its first pull, being served
    assert _code(coord.pull_bundles, node.node_id, 0, 8) == ErrorCode.RATE_LIMITED
    coord.pull_bundles(other.node_id, 0, 8)
    coord.ctx.quotas.end_pull(node.node_id)
    coord.pull_bundles(node.node_id, 0, 8)
    coord.pull_bundles(node.node_id, 0, 8)  # both of its 2 pulls a minute were left
    assert _code(coord.pull_bundles, node.node_id, 0, 8) == ErrorCode.RATE_LIMITED
    assert coord.ctx.quotas.start_pull(node.node_id)  # a refused pull gave its slot back
