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
                           config=SimpleNamespace(cross_tokenizer="off"),
                           policy=SimpleNamespace(card=SimpleNamespace(
                               tokenizer_fingerprint="f")),
                           _registrations_seen=0)


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
