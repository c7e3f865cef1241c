"""Lease rules: expiry, ownership, replay, unknown task/lease, limits, resume."""

from __future__ import annotations

import pytest

from ftis.coordinator.state.sql import SqlState
from ftis.lab.harness.coordinator import (
    FakeClock,
    build_bundle,
    make_coordinator,
    register,
    seal_bundle,
    snapshot,
    verify_only,
)
from ftis.protocol.errors import ErrorCode, FtisError


def _rejects(coordinator, envelope) -> int:
    with pytest.raises(FtisError) as info:
        coordinator.submit_bundle(envelope)
    return info.value.code


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def coord(clock):
    return make_coordinator(clock, lease_ttl_s=60, max_outstanding_leases=4)


def test_lease_has_fresh_ids_deadline_and_real_task(coord, clock) -> None:
    node = register(coord)
    leases = coord.lease_tasks(node.node_id, 3, 4, 32)
    assert len({x.lease_id for x in leases}) == 3
    assert len({x.task_id for x in leases}) == 3
    for lease in leases:
        assert len(lease.lease_id) == 32 and len(lease.task_id) == 32
        assert lease.deadline_ms == clock.now_ms + 60_000
        assert lease.dataset == "chain_sum" and lease.entry.question
        assert (lease.group_size, lease.max_new_tokens) == (4, 32)
    assert [x.entry.index for x in leases] == [0, 1, 2]


def test_valid_submission_is_accepted(coord) -> None:
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    record = coord.submit_bundle(seal_bundle(build_bundle(lease, node), node))
    assert record.verified_rewards == [1.0, 0.0]
    assert coord.state.get_lease_by_task(lease.task_id).bundle_id == record.bundle_id


def test_expired_lease(coord, clock) -> None:
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    envelope = seal_bundle(build_bundle(lease, node), node)
    clock.advance(60.001)
    assert _rejects(coord, envelope) == ErrorCode.LEASE_EXPIRED


def test_deadline_itself_is_still_valid(coord, clock) -> None:
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    clock.now_ms = lease.deadline_ms
    coord.submit_bundle(seal_bundle(build_bundle(lease, node), node))


def test_foreign_lease(coord) -> None:
    owner, thief = register(coord), register(coord)
    (lease,) = coord.lease_tasks(owner.node_id, 1, 2, 16)
    before = snapshot(coord)
    envelope = seal_bundle(build_bundle(lease, thief), thief)
    assert _rejects(coord, envelope) == ErrorCode.LEASE_FOREIGN
    assert snapshot(coord) == before


def test_replay_of_same_bundle_and_of_another_bundle(coord) -> None:
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    envelope = seal_bundle(build_bundle(lease, node), node)
    coord.submit_bundle(envelope)
    before = snapshot(coord)
    assert _rejects(coord, envelope) == ErrorCode.BUNDLE_REPLAYED
    other = seal_bundle(build_bundle(lease, node, correct=[True, True], seed=7), node)
    assert _rejects(coord, other) == ErrorCode.BUNDLE_REPLAYED
    assert snapshot(coord) == before


def test_database_guards_replay_even_without_the_lease_check(coord) -> None:
    
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    verified = verify_only(coord, seal_bundle(build_bundle(lease, node), node))
    coord.state.store_bundle(verified.to_new_bundle(), coord.clock())
    with pytest.raises(FtisError) as info:  # e.g. a concurrent duplicate
        coord.state.store_bundle(verified.to_new_bundle(), coord.clock())
    assert info.value.code == ErrorCode.BUNDLE_REPLAYED


def test_unknown_task_id(coord) -> None:
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 2, 16)
    bundle = build_bundle(lease, node)
    bundle.task_id = "f" * 32
    assert _rejects(coord, seal_bundle(bundle, node)) == ErrorCode.TASK_UNKNOWN


def test_unknown_lease_id(coord) -> None:
    node = register(coord)
    first, second = coord.lease_tasks(node.node_id, 2, 2, 16)
    bundle = build_bundle(first, node)
    bundle.lease_id = second.lease_id  # a real lease, but not this task's
    assert _rejects(coord, seal_bundle(bundle, node)) == ErrorCode.LEASE_UNKNOWN
    bundle.lease_id = "0" * 32
    assert _rejects(coord, seal_bundle(bundle, node)) == ErrorCode.LEASE_UNKNOWN


def test_lease_limit_counts_unanswered_unexpired_leases(coord, clock) -> None:
    node = register(coord)
    leases = coord.lease_tasks(node.node_id, 3, 2, 16)
    with pytest.raises(FtisError) as info:
        coord.lease_tasks(node.node_id, 2, 2, 16)
    assert info.value.code == ErrorCode.LEASE_LIMIT
    coord.submit_bundle(seal_bundle(build_bundle(leases[0], node), node))
    assert len(coord.lease_tasks(node.node_id, 2, 2, 16)) == 2  # 2 outstanding + 2 = 4
    with pytest.raises(FtisError):
        coord.lease_tasks(node.node_id, 1, 2, 16)
    clock.advance(61)  # every lease expired
    assert len(coord.lease_tasks(node.node_id, 4, 2, 16)) == 4
    # Another node has its own quota.
    other = register(coord)
    assert len(coord.lease_tasks(other.node_id, 4, 2, 16)) == 4


@pytest.mark.parametrize(
    ("count", "group_size", "max_new_tokens"),
    [(0, 2, 16), (65, 2, 16), (1, 1, 16), (1, 65, 16), (1, 2, 0), (1, 2, 1025)],
)
def test_invalid_lease_requests(coord, count, group_size, max_new_tokens) -> None:
    node = register(coord)
    with pytest.raises(FtisError) as info:
        coord.lease_tasks(node.node_id, count, group_size, max_new_tokens)
    assert info.value.code == ErrorCode.REQUEST_INVALID


def test_unknown_and_banned_nodes_cannot_lease(coord) -> None:
    with pytest.raises(FtisError) as info:
        coord.lease_tasks("ab" * 16, 1, 2, 16)
    assert info.value.code == ErrorCode.NODE_UNKNOWN
    node = register(coord)
    coord.ban(node.node_id[:8], "test")
    with pytest.raises(FtisError) as info:
        coord.lease_tasks(node.node_id, 1, 2, 16)
    assert info.value.code == ErrorCode.NODE_BANNED


def test_task_cursor_resumes_after_restart(tmp_path, clock) -> None:
    db = f"sqlite:///{tmp_path / 'coord.db'}"
    first = make_coordinator(clock, db=db)
    node = register(first)
    issued = first.lease_tasks(node.node_id, 3, 2, 16)
    assert [x.entry.index for x in issued] == [0, 1, 2]
    first.state.close()
    second = make_coordinator(clock, db=db)
    assert isinstance(second.state, SqlState)
    (lease,) = second.lease_tasks(node.node_id, 1, 2, 16)
    assert lease.entry.index == 3
    # A bundle for a lease issued before the restart is still accepted.
    second.submit_bundle(seal_bundle(build_bundle(issued[0], node), node))


def test_resume_with_a_mix_that_repeats_a_dataset(tmp_path, clock) -> None:
    """Task numbers come from the database's draw counter: a restarted coordinator goes
    on with the next number, and number n is the same task in every process."""
    from ftis.tasks import TaskSpec

    mix = [
        TaskSpec(dataset="chain_sum", config={"min_digits": 1, "max_digits": 1}),
        TaskSpec(dataset="chain_sum", weight=2.0, config={"min_digits": 2, "max_digits": 2}),
    ]
    db = f"sqlite:///{tmp_path / 'coord.db'}"
    first = make_coordinator(clock, db=db, tasks=mix)
    node = register(first)
    leases = first.lease_tasks(node.node_id, 12, 2, 16)
    assert first.state.task_numbers_reserved() == 64  # one block (TASK_BLOCK)
    assert {x.spec_index for x in leases} == {0, 1}
    expected = [first.ctx.tasks.at(n) for n in range(16)]
    assert [(x.spec_index, x.entry) for x in leases] == expected[:12]
    first.state.close()  # a clean stop gives the unused rest of the block back
    reopened = SqlState(db)
    assert reopened.task_numbers_reserved() == 12
    reopened.close()
    second = make_coordinator(clock, db=db, tasks=mix)
    more = second.lease_tasks(node.node_id, 4, 2, 16)
    assert [(x.spec_index, x.entry) for x in more] == expected[12:]
