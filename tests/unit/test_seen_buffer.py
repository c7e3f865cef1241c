"""The coordinator's write-behind buffer of last-seen times and served relay sequences
(``handlers/context.py: SeenBuffer``): values only move forward, a flush hands them to
the state once, and a failed flush keeps them for the next one."""

from __future__ import annotations

import pytest

from ftis.coordinator.handlers.context import SeenBuffer


class _State:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[dict] = []
        self.served: list[dict] = []

    def record_seen(self, seen):
        if self.fail:
            raise RuntimeError("database down")
        self.seen.append(dict(seen))

    def record_relay_served(self, served):
        self.served.append(dict(served))


def test_served_sequences_move_forward_and_flush_once() -> None:
    buf = SeenBuffer()
    assert buf.served_through("a") == 0
    buf.served("a", 7)
    buf.served("a", 3)  # an older page changes nothing
    buf.served("b", 2)
    buf.touch("a", 100)
    assert buf.served_through("a") == 7
    state = _State()
    assert buf.flush(state) == 1
    assert state.served == [{"a": 7, "b": 2}] and state.seen == [{"a": (100, None)}]
    assert buf.served_through("a") == 0  # flushed: the state has it now
    assert buf.flush(state) == 0 and state.served == [{"a": 7, "b": 2}]


def test_a_failed_flush_keeps_everything_for_the_next() -> None:
    buf = SeenBuffer()
    buf.touch("a", 100, policy_version=3)
    buf.served("a", 5)
    with pytest.raises(RuntimeError):
        buf.flush(_State(fail=True))
    buf.served("a", 4)
    assert buf.served_through("a") == 5
    state = _State()
    buf.flush(state)
    assert state.seen == [{"a": (100, 3)}] and state.served == [{"a": 5}]
