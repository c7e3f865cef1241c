"""A node whose coordinator forgot it (NODE_UNKNOWN after a database reset) registers
again (tests/integration/test_node_survives.py); its relay cursor then starts over,
because the new database numbers its relay from 1 again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ftis.client.node.runner import PULL_PAGE, VolunteerNode
from ftis.protocol.errors import ErrorCode, FtisError


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


class _LimitedConn(_Conn):
    """Full pages until the relay quota runs out after ``pages``, then ``code``."""

    def __init__(self, pages: int, code: ErrorCode) -> None:
        super().__init__()
        self.pages, self.code = pages, code

    def pull_bundles(self, cursor: int, max_bundles: int, fingerprint: str):  # noqa: ANN201
        if len(self.cursors) == self.pages:
            raise FtisError(self.code, "more than 67108864 bytes of relay pages per minute")
        self.cursors.append(cursor)
        return SimpleNamespace(bundles=[object()] * PULL_PAGE, next_cursor=cursor + PULL_PAGE)


def test_a_relay_quota_ends_the_rounds_pull_and_keeps_what_was_pulled() -> None:
    conn = _LimitedConn(pages=2, code=ErrorCode.RATE_LIMITED)
    node = _node(conn)
    VolunteerNode._pull_external(node)  # type: ignore[arg-type]  # noqa: SLF001
    assert conn.cursors == [40, 104] and node.pool.cursor == 168  # the next round goes on
    conn = _LimitedConn(pages=1, code=ErrorCode.NODE_BANNED)
    with pytest.raises(FtisError):  # other refusals still stop the round
        VolunteerNode._pull_external(_node(conn))  # type: ignore[arg-type]  # noqa: SLF001
