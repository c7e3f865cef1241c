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


class _SlowPeer:
    """A relay that holds one more bundle on each pull after the first ``empty`` pulls."""

    def __init__(self, empty: int) -> None:
        self.reregistrations = 0
        self.pulls = 0
        self.empty = empty

    def pull_bundles(self, cursor: int, max_bundles: int, fingerprint: str):  # noqa: ANN201
        self.pulls += 1
        fresh = [object()] if self.pulls > self.empty else []
        return SimpleNamespace(bundles=fresh, next_cursor=cursor + len(fresh))


def _waiting_node(conn: _SlowPeer, wait_s: float, want: int) -> SimpleNamespace:
    groups: list[object] = []
    pool = SimpleNamespace(cursor=0, groups=groups, add=groups.append)
    cfg = SimpleNamespace(external_wait_s=wait_s, external_groups=want)
    node = SimpleNamespace(conn=conn, pool=pool, relay_fingerprint="f", _registrations_seen=0,
                           config=cfg)
    node._pull_external = lambda: VolunteerNode._pull_external(node)  # noqa: SLF001
    return node


def test_a_round_waits_for_its_external_groups_pulling_once_a_second(monkeypatch) -> None:
    """``external_wait_s``: a round pulls until the pool holds J groups (a peer slower
    than the learner must not shrink J in an I/J comparison), and gives up at the limit."""
    from ftis.client.node import runner

    clock = [0.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(runner.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    conn = _SlowPeer(empty=2)  # two empty pulls, then one bundle per pull
    node = _waiting_node(conn, wait_s=30.0, want=3)
    waited = VolunteerNode._wait_for_external(node)  # noqa: SLF001
    assert len(node.pool.groups) == 3 and waited == 5.0 and conn.pulls == 5
    # the limit: 2.5 s allow pulls at 1, 2 and 2.5 s, all empty
    conn = _SlowPeer(empty=100)
    node = _waiting_node(conn, wait_s=2.5, want=1)
    clock[0] = 0.0
    assert VolunteerNode._wait_for_external(node) == 2.5  # noqa: SLF001
    assert node.pool.groups == [] and conn.pulls == 3
    # off (the default): no pull, no wait
    conn = _SlowPeer(empty=0)
    node = _waiting_node(conn, wait_s=0.0, want=3)
    assert VolunteerNode._wait_for_external(node) == 0.0 and conn.pulls == 0  # noqa: SLF001
