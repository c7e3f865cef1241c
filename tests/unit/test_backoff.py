"""Retries of the client's coordinator calls: the full-jitter schedule (bounds, cap,
determinism) and :meth:`SwarmConnection._call` under a fake stub and a fake clock
(transient codes retried, coded rejections and other statuses not, giving up after the
outage budget)."""

from __future__ import annotations

import random

import grpc
import pytest

from ftis.client.swarm.connection import RetryPolicy, SwarmConnection, backoff_delay
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, common_pb2, swarm_pb2


class UpperRng(random.Random):
    """Always draws the top of the window: the schedule's ceilings."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_ceilings_double_up_to_the_cap():
    rng = UpperRng()
    assert [backoff_delay(a, rng, base_s=0.5, cap_s=30.0) for a in range(9)] == [
        0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff_delay(10_000, rng, base_s=0.5, cap_s=30.0) == 30.0  # no overflow
    assert backoff_delay(3, rng, base_s=0.1, cap_s=0.5) == 0.5


def test_delays_lie_in_zero_to_ceiling_and_spread_over_it():
    rng = random.Random(7)
    for attempt in range(12):
        ceiling = min(30.0, 0.5 * 2**attempt)
        draws = [backoff_delay(attempt, rng) for _ in range(500)]
        assert all(0.0 <= d <= ceiling for d in draws)
        # full jitter: uniform on [0, ceiling], so the mean is half the ceiling and the
        # draws reach both ends (500 draws: the mean's sd is ceiling * 0.013)
        assert abs(sum(draws) / len(draws) - ceiling / 2) < 0.07 * ceiling
        assert min(draws) < 0.05 * ceiling and max(draws) > 0.95 * ceiling


def test_same_seed_same_schedule():
    def schedule(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [backoff_delay(a, rng) for a in range(10)]

    assert schedule(3) == schedule(3)
    assert schedule(3) != schedule(4)
    first = schedule(3)
    assert first[0] == pytest.approx(random.Random(3).uniform(0, 0.5))


@pytest.mark.parametrize(("attempt", "base", "cap"), [(-1, 0.5, 30), (0, 0, 30), (0, 2, 1)])
def test_bad_arguments(attempt, base, cap):
    with pytest.raises(ValueError):
        backoff_delay(attempt, random.Random(0), base_s=base, cap_s=cap)


def test_gives_up_on_attempts_or_outage():
    policy = RetryPolicy(max_outage_s=60.0)
    assert not policy.gives_up(1, 0.0, 0.4)
    assert not policy.gives_up(50, 59.0, 1.0)  # starts exactly at 60 s: still tried
    assert policy.gives_up(3, 59.0, 1.5)
    assert not RetryPolicy(max_outage_s=None).gives_up(10_000, 1e9, 30.0)
    assert RetryPolicy(max_attempts=3).gives_up(3, 0.0, 0.1)
    assert not RetryPolicy(max_attempts=3).gives_up(2, 0.0, 0.1)


# --- SwarmConnection._call --------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeStub:
    """Heartbeat answers from a script: a status code raises, a response is returned."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.calls: list[int] = []  # auth timestamps of the requests seen

    def Heartbeat(self, request, timeout):  # noqa: ANN001, N802 - the gRPC stub's name
        self.calls.append(request.auth.timestamp_ms)
        item = self.script.pop(0)
        if isinstance(item, grpc.StatusCode):
            raise FakeRpcError(item)
        return item


def _conn(script: list, policy: RetryPolicy, seed: int = 1) -> tuple[SwarmConnection,
                                                                      FakeStub, FakeClock]:
    clock = FakeClock()
    conn = SwarmConnection("127.0.0.1:1", NodeIdentity.generate(), bundle_pb2.ModelCard(),
                           retry=policy, rng=random.Random(seed), sleep=clock.sleep,
                           clock=clock)
    conn.stub = FakeStub(script)
    return conn, conn.stub, clock


UNAVAILABLE, DEADLINE = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED


def test_transient_failures_are_retried_with_the_seeded_schedule():
    ok = swarm_pb2.HeartbeatResponse(reputation=0.75)
    conn, stub, clock = _conn([UNAVAILABLE, DEADLINE, UNAVAILABLE, ok], RetryPolicy())
    try:
        assert conn.heartbeat(3).reputation == 0.75
        rng = random.Random(1)
        assert clock.sleeps == [backoff_delay(a, rng) for a in range(3)]
        assert len(stub.calls) == 4 and conn.transient_failures == 3
        assert all(t > 0 for t in stub.calls)  # every attempt signed afresh
    finally:
        conn.close()


@pytest.mark.parametrize("failure", [
    swarm_pb2.HeartbeatResponse(error=common_pb2.Error(code=ErrorCode.NODE_BANNED,
                                                       reason="banned")),
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED])
def test_coded_rejections_and_other_statuses_are_not_retried(failure):
    conn, stub, clock = _conn([failure, swarm_pb2.HeartbeatResponse()], RetryPolicy())
    try:
        with pytest.raises(FtisError if isinstance(failure, swarm_pb2.HeartbeatResponse)
                           else grpc.RpcError):
            conn.heartbeat(0)
        assert len(stub.calls) == 1 and clock.sleeps == []
    finally:
        conn.close()


def test_gives_up_after_the_outage_budget():
    policy = RetryPolicy(base_s=1.0, cap_s=4.0, max_outage_s=20.0)
    conn, stub, clock = _conn([UNAVAILABLE] * 100, policy, seed=5)
    try:
        with pytest.raises(grpc.RpcError) as info:
            conn.heartbeat(0)
        assert info.value.code() == UNAVAILABLE
        # it waited as long as the budget allows and not longer; the last wait fit in it
        assert sum(clock.sleeps) <= 20.0
        rng = random.Random(5)
        expected = [backoff_delay(a, rng, 1.0, 4.0) for a in range(len(clock.sleeps) + 1)]
        assert clock.sleeps == expected[:-1]
        assert sum(clock.sleeps) + expected[-1] > 20.0  # the next wait would overrun it
        assert len(stub.calls) == len(clock.sleeps) + 1
    finally:
        conn.close()


def test_retries_caps_the_attempts():
    conn, stub, clock = _conn([UNAVAILABLE] * 10, RetryPolicy())
    conn.retry = RetryPolicy(max_attempts=1)  # what `ftis-client status` asks for
    try:
        with pytest.raises(grpc.RpcError):
            conn.heartbeat(0)
        assert len(stub.calls) == 1 and clock.sleeps == []
    finally:
        conn.close()
    legacy = SwarmConnection("127.0.0.1:1", NodeIdentity.generate(), bundle_pb2.ModelCard(),
                             retries=3)
    assert legacy.retry.max_attempts == 3 and legacy.retry.max_outage_s == 1800.0
    legacy.close()


# --- a refused report does not stop the node ---------------------------------------------


def test_a_rate_limited_report_is_skipped_and_other_rejections_raise() -> None:
    from ftis.client.node.runner import report_metrics
    from ftis.protocol.errors import ErrorCode, FtisError

    class Conn:
        def __init__(self, code: int | None) -> None:
            self.code, self.sent = code, []

        def report_metrics(self, step: int, stats: dict, feedback: list) -> None:
            if self.code is not None:
                raise FtisError(self.code, "no")
            self.sent.append(step)

    ok = Conn(None)
    assert report_metrics(ok, 3, {"loss": 1.0}, []) is True and ok.sent == [3]
    assert report_metrics(Conn(ErrorCode.RATE_LIMITED), 4, {}, []) is False
    with pytest.raises(FtisError) as info:
        report_metrics(Conn(ErrorCode.FEEDBACK_INVALID), 5, {}, [])
    assert info.value.code == ErrorCode.FEEDBACK_INVALID


def test_a_rate_limited_heartbeat_does_not_lose_the_round_and_beats_are_paced() -> None:
    """A node whose rounds take under a second (a tiny model) sent one Heartbeat a round,
    more than the coordinator's 60 a minute, and lost the round on the RATE_LIMITED reply
    (found by the security experiment: 9-11 of 20 honest rounds). Now a refused heartbeat
    is skipped (the last reputation kept), other rejections still raise, and beats are at
    least ``HEARTBEAT_MIN_INTERVAL_S`` apart."""
    from ftis.client.node.runner import HEARTBEAT_MIN_INTERVAL_S, VolunteerNode, heartbeat

    class Conn:
        def __init__(self) -> None:
            self.code: int | None = None
            self.beats: list[int] = []

        def heartbeat(self, policy_version: int) -> swarm_pb2.HeartbeatResponse:
            self.beats.append(policy_version)
            if self.code is not None:
                raise FtisError(self.code, "no")
            return swarm_pb2.HeartbeatResponse(reputation=0.75)

    conn = Conn()
    assert heartbeat(conn, 1).reputation == 0.75
    conn.code = ErrorCode.RATE_LIMITED
    assert heartbeat(conn, 2) is None
    conn.code = ErrorCode.NODE_BANNED
    with pytest.raises(FtisError):
        heartbeat(conn, 3)

    node = object.__new__(VolunteerNode)  # only what beat() touches
    node.conn, node.round, node._last_beat_s, node._reputation = Conn(), 0, None, 0.0
    assert node.beat(now=100.0) == 0.75 and node.conn.beats == [0]
    node.round = 1
    assert node.beat(now=100.0 + HEARTBEAT_MIN_INTERVAL_S / 2) == 0.75  # not sent
    assert node.conn.beats == [0]
    node.conn.code = ErrorCode.RATE_LIMITED
    assert node.beat(now=100.0 + HEARTBEAT_MIN_INTERVAL_S) == 0.75  # refused: kept
    assert node.conn.beats == [0, 1]
