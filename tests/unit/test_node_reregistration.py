"""A node whose coordinator forgot it (NODE_UNKNOWN after a database reset) registers
again (tests/integration/test_node_survives.py); its relay cursor then starts over,
because the new database numbers its relay from 1 again."""

from __future__ import annotations

from types import SimpleNamespace

from ftis.client.node.runner import PULL_PAGE, VolunteerNode


class _Conn:
    def __init__(self) -> None:
        self.reregistrations = 0
        self.cursors: list[int] = []

    def pull_bundles(self, cursor: int, max_bundles: int, fingerprint: str):  # noqa: ANN201
        assert max_bundles == PULL_PAGE
        self.cursors.append(cursor)
        return SimpleNamespace(bundles=[], next_cursor=max(cursor, 7))


def _node(conn: _Conn) -> SimpleNamespace:
    return SimpleNamespace(conn=conn, pool=SimpleNamespace(cursor=40, add=lambda b: None),
                           relay_fingerprint="f", _registrations_seen=0)


def test_the_relay_cursor_starts_over_after_a_reregistration() -> None:
    conn = _Conn()
    node = _node(conn)
    VolunteerNode._pull_external(node)  # type: ignore[arg-type]  # noqa: SLF001
    assert conn.cursors == [40] and node.pool.cursor == 40
    conn.reregistrations = 1  # the coordinator lost its database meanwhile
    VolunteerNode._pull_external(node)  # type: ignore[arg-type]  # noqa: SLF001
    assert conn.cursors == [40, 0] and node.pool.cursor == 7
    VolunteerNode._pull_external(node)  # type: ignore[arg-type]  # noqa: SLF001
    assert conn.cursors == [40, 0, 7]  # once only


def test_a_busy_coordinator_gets_the_same_bundle_once_more() -> None:
    import random

    from ftis.client.swarm.connection import SwarmConnection
    from ftis.protocol.errors import ErrorCode, FtisError
    from ftis.protocol.identity import NodeIdentity
    from ftis.v1 import bundle_pb2, common_pb2, swarm_pb2

    sent: list[bytes] = []
    replies = [ErrorCode.VERIFICATION_BUSY, 0, ErrorCode.VERIFICATION_BUSY,
               ErrorCode.VERIFICATION_BUSY]

    def submit(request, timeout):  # noqa: ANN001, ANN202, ARG001
        sent.append(request.envelope.SerializeToString())
        return swarm_pb2.SubmitBundleResponse(error=common_pb2.Error(code=replies.pop(0)))

    sleeps: list[float] = []
    conn = SwarmConnection("127.0.0.1:1", NodeIdentity.generate(), bundle_pb2.ModelCard(),
                           rng=random.Random(0), sleep=sleeps.append)
    conn.stub = SimpleNamespace(SubmitBundle=submit)  # type: ignore[assignment]
    bundle = bundle_pb2.Bundle(task_id="t", node_id=conn.node_id)
    assert conn.submit_bundle(bundle).error.code == 0
    assert len(sent) == 2 and sent[0] == sent[1] and len(sleeps) == 1  # the same bytes
    try:  # busy twice in a row: one retry only, then the refusal reaches the caller
        conn.submit_bundle(bundle)
        raise AssertionError("expected VERIFICATION_BUSY")
    except FtisError as err:
        assert err.code == ErrorCode.VERIFICATION_BUSY
    conn.close()
