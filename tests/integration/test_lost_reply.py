"""Nothing acknowledged is lost, not even an acknowledgement (issue 12): when the reply
to a stored bundle is lost and the client retries the same signed envelope, the
coordinator answers BUNDLE_REPLAYED *with* the stored bundle's id and verified rewards,
stores nothing and charges no one, and the client's connection takes that as its
acknowledgement. Real gRPC, real coordinator (:mod:`trust_swarm`)."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from ftis.client.swarm.connection import RetryPolicy, SwarmConnection
from ftis.lab.harness.trust_swarm import running_swarm
from ftis.protocol.envelope import seal
from ftis.protocol.errors import ErrorCode

pytestmark = pytest.mark.integration


class _Timeout(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED


class _LoseFirstReply:
    """A stub whose first SubmitBundle reaches the coordinator but whose reply is lost."""

    def __init__(self, stub: object) -> None:
        self._stub = stub
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)

    def SubmitBundle(self, request: object, timeout: float | None = None) -> object:  # noqa: N802
        self.calls += 1
        reply = self._stub.SubmitBundle(request, timeout=timeout)  # type: ignore[attr-defined]
        if self.calls == 1:
            assert reply.error.code == 0, reply.error
            raise _Timeout
        return reply


def test_a_resubmitted_envelope_gets_its_stored_acknowledgement(tmp_path: Path) -> None:
    with running_swarm(tmp_path) as swarm:
        a = swarm.honest_a
        envelope = seal("bundle", a.honest_bundle(a.lease()[0]), a.identity)
        first = a.submit(envelope)
        assert first.error.code == 0
        before = swarm.server.state.get_node(a.node_id)
        again = a.submit(envelope)
        assert again.error.code == ErrorCode.BUNDLE_REPLAYED
        assert again.bundle_id == first.bundle_id
        assert list(again.verified_rewards) == list(first.verified_rewards) == [1.0, 0.0]
        after = swarm.server.state.get_node(a.node_id)
        assert after.standing == before.standing  # charged to no one, credited nothing
        assert after.bundles_accepted == before.bundles_accepted
        assert swarm.stored_by(a).count(first.bundle_id) == 1


def test_the_client_takes_a_replayed_acknowledgement_after_a_lost_reply(
        tmp_path: Path) -> None:
    with running_swarm(tmp_path) as swarm:
        a = swarm.honest_a
        conn = SwarmConnection(swarm.server.address, a.identity, a.card,
                               retry=RetryPolicy(base_s=0.01, cap_s=0.02),
                               rng=random.Random(0))
        try:
            lossy = _LoseFirstReply(conn.stub)
            conn.stub = lossy  # type: ignore[assignment]
            bundle = a.honest_bundle(a.lease()[0])
            reply = conn.submit_bundle(bundle)
            assert lossy.calls == 2 and conn.transient_failures == 1
            assert reply.error.code == ErrorCode.BUNDLE_REPLAYED  # a retry's answer ...
            assert list(reply.verified_rewards) == [1.0, 0.0]  # ... with the rewards
            assert reply.bundle_id in swarm.stored_by(a)
        finally:
            conn.close()
