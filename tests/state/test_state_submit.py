"""The State contract, part 2 (issue 12): the submit path in one read and one write
(``submission_snapshot``, ``commit_submission``), batched last-seen times, evidence for
several nodes, leases in blocks from the shared draw counter; on SQLite and PostgreSQL.
Concurrency (threads, processes) is in test_state_concurrency.py."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import pytest
from state_records import (
    T0,
    Recorder,
    add_node,
    apply_evidence,
    lease,
    make_leases,
    new_bundle,
    node_id,
    rows,
)

from ftis.coordinator import reputation
from ftis.coordinator.reputation import Evidence, ReputationConfig, Standing
from ftis.coordinator.state.base import CommittedVerdict, Verdict
from ftis.coordinator.state.sql import (
    TASK_BLOCK,
    LeaseRow,
    ProofRow,
    SqlState,
    VerdictRow,
    dump_tables,
)
from ftis.protocol.errors import ErrorCode, FtisError

ALL_TABLES = ("nodes", "reputation", "leases", "bundles", "verdicts", "evidence", "proofs",
              "feedback_bundles",
              "counters")


def _accept(the_lease, events=(), **kwargs) -> Verdict:
    bundle = new_bundle(the_lease, **kwargs)
    return Verdict(node_id=bundle.node_id, bundle_id=bundle.bundle_id, code=0,
                   reason="accepted", bundle=bundle, evidence=tuple(events))


# -- submission_snapshot ----------------------------------------------------------------


def test_snapshot_of_unknowns(state: SqlState) -> None:
    snap = state.submission_snapshot(node_id("ghost"), "task-x", "b-x", T0, T0)
    assert snap.node is None and snap.lease is None and snap.already_stored is False
    assert snap.negative_reporters == frozenset()
    assert (snap.recent_submissions, snap.recent_bytes) == (0, 0)


def test_snapshot_contents(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    other = add_node(state, "other").node_id
    r1, r2 = add_node(state, "r1").node_id, add_node(state, "r2").node_id
    leases = [lease(a, n) for n in range(1, 5)] + [lease(other, 9)]
    state.insert_leases(leases)
    early = state.store_bundle(new_bundle(leases[0], size_bytes=1000), T0 - 61_000)
    state.store_bundle(new_bundle(leases[1], size_bytes=300), T0 - 60_000)   # at window start
    state.store_bundle(new_bundle(leases[2], size_bytes=200), T0 - 1)
    state.store_bundle(new_bundle(leases[4], size_bytes=5000), T0 - 1)       # other node
    state.record_rejection(a, None, ErrorCode.LEASE_EXPIRED, "late", T0 - 30_000)
    state.record_rejection(a, None, ErrorCode.LEASE_EXPIRED, "late", T0 - 90_000)  # too old
    state.record_rejection(other, None, ErrorCode.LEASE_EXPIRED, "late", T0)
    cfg = ReputationConfig()
    apply_evidence(state, a, [Evidence(reputation.FEEDBACK, -0.5, reporter_node_id=r1)],
                         T0 - 7_200_000, cfg)                                 # before since
    apply_evidence(state, a, [Evidence(reputation.FEEDBACK, -0.5, reporter_node_id=r2),
                             Evidence(reputation.FEEDBACK, -0.1, reporter_node_id=r2),
                             Evidence(reputation.FEEDBACK, 0.5, reporter_node_id=r1)],
                         T0 - 5, cfg)

    snap = state.submission_snapshot(a, "task-000004", early.bundle_id,
                                     since_ms=T0 - 3_600_000, window_start_ms=T0 - 60_000)
    assert snap.node == state.get_node(a)
    assert snap.lease == leases[3]
    assert snap.already_stored is True
    assert snap.negative_reporters == frozenset({r2})
    # verdicts of alice at or after the window start: 2 stored bundles + 1 rejection
    assert snap.recent_submissions == 3
    assert snap.recent_bytes == 300 + 200
    later = state.submission_snapshot(a, "task-000003", "not-stored", T0 - 8_000_000, T0)
    assert later.lease.bundle_id == new_bundle(leases[2]).bundle_id  # answered lease
    assert later.already_stored is False and later.negative_reporters == frozenset({r1, r2})
    assert (later.recent_submissions, later.recent_bytes) == (0, 0)


# -- commit_submission ------------------------------------------------------------------
# Every test below runs twice per backend: with the node read locked by the commit, and
# with ``expected`` (the node as the submission snapshot read it: the optimistic path,
# one statement on PostgreSQL). The results must be the same.

Commit = Callable[..., CommittedVerdict]


@pytest.fixture(params=["locked", "expected"])
def commit(request: pytest.FixtureRequest, state: SqlState) -> Commit:
    def run(verdict: Verdict, now_ms: int, update=None) -> CommittedVerdict:
        expected = None
        if request.param == "expected" and verdict.node_id is not None:
            expected = state.get_node(verdict.node_id)
        return state.commit_submission(verdict, now_ms, update, expected=expected)

    return run


def test_commit_accepted(state: SqlState, commit: Commit) -> None:
    a = add_node(state, "alice").node_id
    the_lease = lease(a, 1)
    state.insert_leases([the_lease])
    event = Evidence("bundle_verified", 1.0, "ok", "", "b")
    update = Recorder([event], T0 + 10)
    verdict = _accept(the_lease, [event], mismatches=2, size_bytes=77, policy_version=5)
    committed = commit(verdict, T0 + 10, update)

    bundle = committed.bundle
    assert bundle is not None and bundle.sequence == 1
    assert (bundle.bundle_id, bundle.lease_id, bundle.dataset) == (
        verdict.bundle_id, "lease-000001", "chain_sum")
    assert (bundle.size_bytes, bundle.stored_at_ms, bundle.policy_version) == (77, T0 + 10, 5)
    assert committed.proof_id is None
    node = committed.node
    assert node == state.get_node(a)
    assert (node.bundles_accepted, node.bundles_rejected, node.reward_mismatches) == (1, 0, 2)
    assert (node.completions, node.completion_tokens) == (4, 24)
    assert (node.last_seen_ms, node.policy_version) == (T0 + 10, 5)
    # update saw the stored standing and the count after this bundle
    assert update.calls == [(Standing(0.0, 0.0, T0, False), 1)]
    assert (node.rep_good, node.rep_bad, node.rep_updated_ms, node.quarantined) == (
        1.0, 0.0, T0 + 10, False)
    assert state.get_lease_by_task("task-000001").bundle_id == verdict.bundle_id
    assert [(v.node_id, v.bundle_id, v.code, v.reason, v.at_ms) for v in rows(state, VerdictRow)
            ] == [(a, verdict.bundle_id, 0, "accepted", T0 + 10)]
    assert [(e.kind, e.weight, e.detail, e.bundle_id, e.at_ms) for e in state.list_evidence(a)
            ] == [("bundle_verified", 1.0, "ok", "b", T0 + 10)]
    assert rows(state, ProofRow) == []


def test_commit_accepted_without_evidence(state: SqlState, commit: Commit) -> None:
    a = add_node(state, "alice").node_id
    the_lease = lease(a, 1)
    state.insert_leases([the_lease])
    committed = commit(_accept(the_lease), T0)  # no update needed
    assert committed.node.bundles_accepted == 1
    assert (committed.node.rep_good, committed.node.rep_updated_ms) == (0.0, T0)
    assert state.list_evidence(a) == []


def test_commit_rejected_changes_only_the_counter_and_logs(state: SqlState, commit: Commit) -> None:
    a = add_node(state, "alice").node_id
    state.insert_leases([lease(a, 1)])
    before = dump_tables(state)  # nodes, leases, bundles
    event = Evidence("lease_expired", -0.25, "LEASE_EXPIRED: late", "", "bid")
    update = Recorder([event], T0 + 1)
    committed = commit(
        Verdict(a, "bid", ErrorCode.LEASE_EXPIRED, "late", evidence=(event,)), T0 + 1, update)
    assert dump_tables(state) == before
    assert committed.bundle is None and committed.proof_id is None
    assert committed.node == state.get_node(a)
    assert (committed.node.bundles_rejected, committed.node.bundles_accepted) == (1, 0)
    assert (committed.node.rep_bad, committed.node.quarantined) == (0.25, True)
    assert update.calls == [(Standing(0.0, 0.0, T0, False), 0)]
    assert [(v.node_id, v.bundle_id, v.code, v.reason) for v in rows(state, VerdictRow)] == [
        (a, "bid", int(ErrorCode.LEASE_EXPIRED), "late")]
    assert [(e.kind, e.weight, e.bundle_id) for e in state.list_evidence(a)] == [
        ("lease_expired", -0.25, "bid")]
    # a rejection without evidence still counts
    commit(Verdict(a, None, ErrorCode.NODE_BANNED, "banned"), T0 + 2)
    assert state.get_node(a).bundles_rejected == 2
    assert state.rejections_by_code(a) == {int(ErrorCode.LEASE_EXPIRED): 1,
                                           int(ErrorCode.NODE_BANNED): 1}


def test_commit_rejected_unknown_or_unsigned_writes_the_verdict_only(
        state: SqlState, commit: Commit) -> None:
    add_node(state, "alice")
    before = dump_tables(state, ALL_TABLES)
    event = Evidence("rejected", -1.0)
    ghost = commit(
        Verdict(node_id("ghost"), "b1", ErrorCode.NODE_UNKNOWN, "who", evidence=(event,),
                proof_envelope=b"env", ban_reason="x"), T0, Recorder([event], T0))
    unsigned = commit(
        Verdict(None, None, ErrorCode.SIGNATURE_INVALID, "bad signature"), T0)
    assert ghost.node is None and ghost.bundle is None and ghost.proof_id is None
    assert unsigned.node is None
    after = dump_tables(state, ALL_TABLES)
    assert {t: after[t] for t in ALL_TABLES if t != "verdicts"} == {
        t: before[t] for t in ALL_TABLES if t != "verdicts"}
    assert [(v.node_id, v.code) for v in rows(state, VerdictRow)] == [
        (node_id("ghost"), int(ErrorCode.NODE_UNKNOWN)), (None, int(ErrorCode.SIGNATURE_INVALID))]


def test_commit_proof_and_ban(state: SqlState, commit: Commit) -> None:
    a = add_node(state, "alice").node_id
    event = Evidence("text_mismatch", -4.0, "TEXT_MISMATCH: x (signed envelope kept as proof)",
                     "", "bid")
    committed = commit(
        Verdict(a, "bid", ErrorCode.TEXT_MISMATCH, "x", evidence=(event,),
                proof_envelope=b"signed-envelope", ban_reason="proof: TEXT_MISMATCH"),
        T0 + 3, Recorder([event], T0 + 3))
    assert committed.proof_id is not None
    proofs = rows(state, ProofRow)
    assert [(p.id, p.node_id, p.bundle_id, p.code, p.envelope, p.at_ms) for p in proofs] == [
        (committed.proof_id, a, "bid", int(ErrorCode.TEXT_MISMATCH), b"signed-envelope", T0 + 3)]
    node = state.get_node(a)
    assert node == committed.node
    assert (node.banned, node.ban_reason, node.bundles_rejected) == (
        True, "proof: TEXT_MISMATCH", 1)
    assert (node.rep_bad, node.quarantined) == (4.0, True)
    assert [e.detail for e in state.list_evidence(a)] == [event.detail]


def test_commit_with_the_real_reputation_step(state: SqlState, commit: Commit) -> None:
    """``reputation.apply`` partially applied, as the handlers do: hand-computed."""
    cfg = ReputationConfig(half_life_s=100.0, probation_bundles=1)
    a = add_node(state, "alice").node_id
    leases = [lease(a, 1), lease(a, 2)]
    state.insert_leases(leases)

    def step(events, now):  # what reputation.standing_update binds
        return lambda standing, accepted: reputation.apply(standing, events, now, accepted, cfg)

    good = Evidence(reputation.BUNDLE_VERIFIED, 1.0)
    commit(_accept(leases[0], [good]), T0, step([good], T0))
    # 100 s = one half-life later: good 1 -> 0.5; then -2 x 2 mismatches = bad 4
    bad = [Evidence(reputation.REWARD_MISMATCH, -2.0), Evidence(reputation.REWARD_MISMATCH, -2.0)]
    committed = commit(_accept(leases[1], bad, mismatches=2), T0 + 100_000,
                                        step(bad, T0 + 100_000))
    node = committed.node
    assert math.isclose(node.rep_good, 0.5) and math.isclose(node.rep_bad, 4.0)
    assert node.rep_updated_ms == T0 + 100_000
    # score 1.5 / 6.5 = 0.23 < 0.3 (past probation with 2 bundles): quarantined
    assert node.quarantined and node.bundles_accepted == 2
    # the sender is quarantined now: neither bundle is relayed
    reader = add_node(state, "reader").node_id
    page, _ = state.pull_bundles(requester_id=reader, cursor=0, limit=10, max_bytes=10**6)
    assert page == []


def test_commit_accepted_while_quarantined_is_never_relayed(
        state: SqlState, commit: Commit) -> None:
    a = add_node(state, "alice").node_id
    reader = add_node(state, "reader").node_id
    apply_evidence(state, a, [Evidence("rejected", -10.0)], T0, ReputationConfig())
    leases = [lease(a, 1), lease(a, 2)]
    state.insert_leases(leases)
    release = Evidence("bundle_verified", 100.0)
    committed = commit(_accept(leases[0], [release]), T0,
                                        Recorder([release], T0))
    assert committed.node.quarantined is False  # released by this bundle's evidence...
    later = commit(_accept(leases[1]), T0 + 1).bundle
    page, _ = state.pull_bundles(requester_id=reader, cursor=0, limit=10, max_bytes=10**6)
    assert [r.bundle_id for r in page] == [later.bundle_id]  # ...but stored while in it


def test_commit_replay_writes_nothing(state: SqlState, commit: Commit) -> None:
    a = add_node(state, "alice").node_id
    leases = [lease(a, 1), lease(a, 2)]
    state.insert_leases(leases)
    event = Evidence("bundle_verified", 1.0)
    commit(_accept(leases[0], [event]), T0, Recorder([event], T0))
    before = dump_tables(state, ALL_TABLES)
    replays = [
        _accept(leases[0], [event], tag="another payload"),  # lease already answered
        _accept(leases[0], [event]),                         # byte-identical
    ]
    stored_id = replays[1].bundle_id  # a stored payload id on an unanswered lease
    moved = dataclasses.replace(new_bundle(leases[1]), bundle_id=stored_id)
    replays.append(Verdict(a, stored_id, 0, "accepted", bundle=moved, evidence=(event,)))
    for verdict in replays:
        update = Recorder([event], T0 + 5)
        with pytest.raises(FtisError) as info:
            commit(verdict, T0 + 5, update)
        assert info.value.code == ErrorCode.BUNDLE_REPLAYED
    assert dump_tables(state, ALL_TABLES) == before


def test_commit_argument_checks(state: SqlState, commit: Commit) -> None:
    a = add_node(state, "alice").node_id
    the_lease = lease(a, 1)
    state.insert_leases([the_lease])
    event = Evidence("rejected", -1.0)
    with pytest.raises(ValueError):
        commit(Verdict(a, None, 5, "x", evidence=(event,)), T0)  # no update
    with pytest.raises(ValueError):
        commit(Verdict(a, None, 0, "accepted"), T0)  # code 0 without bundle
    with pytest.raises(ValueError):
        accepted = _accept(the_lease)
        commit(Verdict(node_id("x"), accepted.bundle_id, 0, "accepted",
                                        bundle=accepted.bundle), T0)
    ghost_lease = lease(node_id("ghost"), 2)
    with pytest.raises(FtisError) as info:
        commit(_accept(ghost_lease), T0)
    assert info.value.code == ErrorCode.NODE_UNKNOWN
    assert rows(state, VerdictRow) == []


def test_commit_with_expected_is_one_statement_on_postgres(state: SqlState,
                                                         backend: str) -> None:
    """The optimistic commit of an accepted bundle: ONE statement on PostgreSQL (no
    BEGIN/COMMIT either: autocommit), against the locked path's seven; on SQLite the
    savepoint holds six statements instead of seven (no read of the node)."""
    from sqlalchemy import event as sa_event

    a = add_node(state, "alice").node_id
    leases = [lease(a, 1), lease(a, 2)]
    state.insert_leases(leases)
    seen: list[str] = []

    def record(conn, cursor, statement, *args) -> None:
        seen.append(statement.split(None, 1)[0].upper())

    sa_event.listen(state.engine, "before_cursor_execute", record)
    try:
        ev = Evidence("bundle_verified", 1.0)
        expected = state.get_node(a)
        seen.clear()
        state.commit_submission(_accept(leases[0], [ev]), T0, Recorder([ev], T0),
                                expected=expected)
        optimistic = list(seen)
        seen.clear()
        state.commit_submission(_accept(leases[1], [ev]), T0 + 1, Recorder([ev], T0 + 1))
        locked = list(seen)
    finally:
        sa_event.remove(state.engine, "before_cursor_execute", record)
    if backend == "postgres":
        assert optimistic == ["WITH"]
        assert locked == ["SELECT", "UPDATE", "INSERT", "INSERT", "UPDATE", "INSERT",
                          "UPDATE"]
    else:
        core = [x for x in optimistic if x not in ("BEGIN", "SAVEPOINT", "RELEASE")]
        assert core == ["UPDATE", "UPDATE", "UPDATE", "INSERT", "INSERT", "INSERT"]
        assert len([x for x in locked if x not in ("BEGIN", "SAVEPOINT", "RELEASE")]) == 7
    node = state.get_node(a)
    assert (node.bundles_accepted, node.rep_good, node.rep_updated_ms) == (2, 2.0, T0 + 1)


def test_commit_with_stale_expected_falls_back(state: SqlState) -> None:
    """When the node changed between the snapshot and the commit (evidence from
    feedback, another bundle of the same node), the optimistic write changes nothing
    and the locked path commits from the fresh rows."""
    a = add_node(state, "alice").node_id
    leases = [lease(a, 1), lease(a, 2), lease(a, 3)]
    state.insert_leases(leases)
    ev = Evidence("bundle_verified", 1.0)
    stale = state.get_node(a)
    # the standing changed since (feedback): good 0 -> 3
    apply_evidence(state, a, [Evidence("feedback", 3.0, "", "r")], T0, ReputationConfig())
    fresh = state.get_node(a).standing
    update = Recorder([ev], T0 + 5)
    committed = state.commit_submission(_accept(leases[0], [ev]), T0 + 5, update,
                                        expected=stale)
    assert update.calls[-1] == (fresh, 1)  # the locked path's call, on the fresh standing
    assert committed.node == state.get_node(a)
    assert (committed.node.rep_good, committed.node.bundles_accepted) == (
        fresh.good + 1.0, 1)
    # bundles_accepted changed since (another bundle): same
    stale = committed.node
    state.commit_submission(_accept(leases[1]), T0 + 6, expected=stale)
    update = Recorder([ev], T0 + 7)
    committed = state.commit_submission(_accept(leases[2], [ev]), T0 + 7, update,
                                        expected=stale)
    assert update.calls[-1] == (stale.standing, 3)
    assert committed.node == state.get_node(a) and committed.node.bundles_accepted == 3
    assert len(rows(state, VerdictRow)) == 3
    assert len(state.list_evidence(a)) == 3  # the feedback and two bundles' events


# -- record_seen --------------------------------------------------------------------------


def test_record_seen_moves_forward_only(state: SqlState) -> None:
    a = add_node(state, "alice", now_ms=T0).node_id
    b = add_node(state, "bob", now_ms=T0).node_id
    state.record_seen({a: (T0 + 100, 4), b: (T0 + 50, None), node_id("ghost"): (T0 + 1, 1)})
    assert (state.get_node(a).last_seen_ms, state.get_node(a).policy_version) == (T0 + 100, 4)
    assert (state.get_node(b).last_seen_ms, state.get_node(b).policy_version) == (T0 + 50, 0)
    assert state.get_node(node_id("ghost")) is None
    # older entries change nothing (not even the policy version); None keeps the version
    state.record_seen({a: (T0 + 10, 9), b: (T0 + 60, None)})
    assert (state.get_node(a).last_seen_ms, state.get_node(a).policy_version) == (T0 + 100, 4)
    assert (state.get_node(b).last_seen_ms, state.get_node(b).policy_version) == (T0 + 60, 0)
    state.record_seen({a: (T0 + 100, 5)})  # same time: the newer version is kept
    assert state.get_node(a).policy_version == 5
    state.record_seen({})


# -- apply_evidence_many -------------------------------------------------------------------


def test_apply_evidence_many(state: SqlState) -> None:
    a, b, c = (add_node(state, n).node_id for n in ("alice", "bob", "carol"))
    e1, e2, e3 = (Evidence(reputation.FEEDBACK, -1.0, "r1", c), Evidence("x", 2.0),
                  Evidence(reputation.FEEDBACK, 0.5, "r2", a))
    updates: dict[tuple[str, ...], Recorder] = {}

    def update(events):
        updates[tuple(e.detail for e in events)] = recorder = Recorder(events, T0 + 9)
        return recorder

    out = state.apply_evidence_many([(b, e1), (a, e3), (b, e2)], T0 + 9, update)
    assert list(out) == [b, a]  # first appearance
    assert set(updates) == {("r1", ""), ("r2",)}  # one update per node, its own events
    assert (out[b].rep_good, out[b].rep_bad, out[b].quarantined) == (2.0, 1.0, False)
    assert (out[a].rep_good, out[a].rep_bad) == (0.5, 0.0)
    assert out[b] == state.get_node(b) and out[a] == state.get_node(a)
    assert [(e.kind, e.weight, e.reporter_node_id) for e in state.list_evidence(b)] == [
        ("x", 2.0, ""), (reputation.FEEDBACK, -1.0, c)]
    assert state.negative_reporters(b, T0) == {c}
    assert state.apply_evidence_many([], T0, update) == {}


def test_apply_evidence_many_unknown_node_writes_nothing(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    before = dump_tables(state, ALL_TABLES)
    with pytest.raises(FtisError) as info:
        state.apply_evidence_many(
            [(a, Evidence("x", 1.0)), (node_id("ghost"), Evidence("x", 1.0))], T0,
            lambda events: Recorder(events, T0))
    assert info.value.code == ErrorCode.NODE_UNKNOWN
    assert dump_tables(state, ALL_TABLES) == before


def test_apply_evidence_many_records_counted_feedback_bundles_once(state: SqlState) -> None:
    a, r = (add_node(state, n).node_id for n in ("alice", "reporter"))
    update = lambda events: Recorder(events, T0)  # noqa: E731
    feedback = Evidence(reputation.FEEDBACK, -0.5, "f", r, "b1")
    out = state.apply_evidence_many([(a, feedback)], T0, update, counted=(r, ["b1", "b2", "b1"]))
    assert out[a].rep_bad == 0.5
    assert state.reported_bundles(r, ["b1", "b2", "b3"]) == {"b1", "b2"}
    assert state.reported_bundles(a, ["b1"]) == set()  # per reporter
    assert state.reported_bundles(r, []) == set() and state.reported_bundles("\x00", ["b1"]) \
        == set()
    # counted bundles alone (no evidence) are recorded too
    assert state.apply_evidence_many([], T0, update, counted=(r, ["b3"])) == {}
    assert state.reported_bundles(r, ["b3"]) == {"b3"}
    # a concurrent report that counted the same bundle: refused whole, nothing written
    before = dump_tables(state, ALL_TABLES)
    with pytest.raises(FtisError) as info:
        state.apply_evidence_many([(a, feedback)], T0 + 1, update, counted=(r, ["b4", "b2"]))
    assert info.value.code == ErrorCode.FEEDBACK_INVALID
    assert dump_tables(state, ALL_TABLES) == before


def test_record_relay_served_moves_forward_only(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    b = add_node(state, "bob").node_id
    assert state.get_node(a).relay_served_seq == 0
    state.record_relay_served({a: 7, b: 3, node_id("ghost"): 9, "\x00": 1})
    assert (state.get_node(a).relay_served_seq, state.get_node(b).relay_served_seq) == (7, 3)
    state.record_relay_served({a: 5})
    assert state.get_node(a).relay_served_seq == 7
    state.record_relay_served({})


# -- lease_block and the draw counter -----------------------------------------------------


def test_lease_block(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    b = add_node(state, "bob").node_id
    assert state.task_numbers_reserved() == 0
    starts: list[int] = []

    def make(owner, count, now=T0, ttl=1000):
        inner = make_leases(owner, count, now, ttl)
        return lambda start: starts.append(start) or inner(start)

    first = state.lease_block(a, 3, T0, 4, make(a, 3))
    assert [x.task_id for x in first] == ["task-000000", "task-000001", "task-000002"]
    assert state.get_lease_by_task("task-000001") == first[1]
    # one block of TASK_BLOCK numbers was reserved; the next calls take from it
    assert state.task_numbers_reserved() == TASK_BLOCK == 64
    second = state.lease_block(b, 2, T0, 4, make(b, 2))
    assert [x.task_id for x in second] == ["task-000003", "task-000004"]
    assert starts == [0, 3] and state.task_numbers_reserved() == 64
    with pytest.raises(FtisError) as info:
        state.lease_block(a, 2, T0, 4, make(a, 2))
    assert info.value.code == ErrorCode.LEASE_LIMIT
    assert info.value.reason == ("3 leases outstanding + 2 requested > limit 4; "
                                 "submit or let them expire")
    assert starts == [0, 3]  # nothing handed out
    # an answered lease and an expired one no longer count
    state.commit_submission(_accept(first[0]), T0 + 1)
    assert [x.task_id for x in state.lease_block(a, 2, T0 + 1, 4, make(a, 2, T0 + 1))] == [
        "task-000005", "task-000006"]
    assert [x.task_id for x in state.lease_block(a, 4, T0 + 5000, 4, make(a, 4, T0 + 5000))
            ] == [f"task-{n:06d}" for n in range(7, 11)]
    assert state.task_numbers_reserved() == 64
    assert state.count_outstanding_leases(a, T0 + 5000) == 4
    assert state.lease_block(a, 0, T0 + 5000, 4, make(a, 0)) == []
    with pytest.raises(FtisError) as info:
        state.lease_block(node_id("ghost"), 1, T0, 4, make(a, 1))
    assert info.value.code == ErrorCode.NODE_UNKNOWN
    assert state.task_numbers_reserved() == 64


def test_task_blocks_across_processes_gaps_and_close(state: SqlState, state_url: str) -> None:
    """Blocks of 4: a request longer than the rest of a block starts a new block (the
    rest is a gap), one longer than a block reserves exactly its own length, a second
    SqlState (another worker process) gets its own blocks, ``close`` gives back an
    unused rest only when nobody reserved after it, and a crash (no close) leaves it a
    gap."""
    a = add_node(state, "alice").node_id
    state.close()

    def numbers(block: list) -> list[int]:
        return [int(x.task_id.split("-")[1]) for x in block]

    one = SqlState(state_url, task_block=4)
    two = SqlState(state_url, task_block=4)
    try:
        assert numbers(one.lease_block(a, 3, T0, 99, make_leases(a, 3))) == [0, 1, 2]
        assert numbers(two.lease_block(a, 1, T0, 99, make_leases(a, 1))) == [4]
        assert one.task_numbers_reserved() == 8
        # 1 number left in one's block, 3 wanted: a new block, 3 is skipped
        assert numbers(one.lease_block(a, 3, T0, 99, make_leases(a, 3))) == [8, 9, 10]
        assert numbers(two.lease_block(a, 2, T0, 99, make_leases(a, 2))) == [5, 6]
        # longer than a block: exactly its own length, the old rest (11) is kept
        assert numbers(one.lease_block(a, 6, T0, 99, make_leases(a, 6))) == list(range(12, 18))
        assert numbers(one.lease_block(a, 1, T0, 99, make_leases(a, 1))) == [11]
        assert one.task_numbers_reserved() == 18
        # a refused request takes no number
        with pytest.raises(FtisError):
            two.lease_block(a, 200, T0, 99, make_leases(a, 200))
        assert numbers(two.lease_block(a, 1, T0, 99, make_leases(a, 1))) == [7]
        two.close()  # its block is used up: nothing to give back
        assert one.task_numbers_reserved() == 18
    finally:
        one.close()  # one's block (12..17) is used up as well
    three = SqlState(state_url, task_block=4)
    assert numbers(three.lease_block(a, 1, T0, 99, make_leases(a, 1))) == [18]
    assert three.task_numbers_reserved() == 22
    three.close()  # 19..21 unused and nobody reserved after: given back
    four = SqlState(state_url, task_block=4)
    assert four.task_numbers_reserved() == 19
    assert numbers(four.lease_block(a, 1, T0, 99, make_leases(a, 1))) == [19]
    four.engine.dispose()  # a crash: 20..22 are never handed out
    five = SqlState(state_url, task_block=4)
    try:
        assert numbers(five.lease_block(a, 1, T0, 99, make_leases(a, 1))) == [23]
        issued = sorted(int(x.task_id.split("-")[1]) for x in rows(five, LeaseRow))
        assert issued == sorted({*range(0, 3), *range(4, 19), 19, 23} - {3})
        assert len(issued) == len(set(issued))
    finally:
        five.close()
    with pytest.raises(ValueError, match="task_block"):
        SqlState(state_url, task_block=0)


def test_snapshot_reads_are_index_scans(state: SqlState, backend: str) -> None:
    """The submission snapshot (one statement since it was folded into a single round
    trip) reads every table through an index (on PostgreSQL with sequential scans
    discouraged, since tiny tables would be scanned anyway)."""
    from sqlalchemy import event

    a = add_node(state, "alice").node_id
    state.insert_leases([lease(a, 1), lease(a, 2)])
    state.store_bundle(new_bundle(lease(a, 1)), T0)
    state.record_rejection(a, None, ErrorCode.LEASE_EXPIRED, "late", T0)
    apply_evidence(state, a, [Evidence(reputation.FEEDBACK, -1.0, reporter_node_id="r")], T0,
                         ReputationConfig())
    captured: list[tuple[str, object]] = []

    def grab(conn, cursor, statement, parameters, context, executemany) -> None:
        if "FROM" in statement.upper().split():
            captured.append((statement, parameters))

    event.listen(state.engine, "before_cursor_execute", grab)
    try:
        state.submission_snapshot(a, "task-000002", "b" * 64, T0 - 1000, T0 - 1000)
    finally:
        event.remove(state.engine, "before_cursor_execute", grab)
    assert len(captured) == 1  # one round trip
    prefix = "EXPLAIN QUERY PLAN " if backend == "sqlite" else "EXPLAIN "
    with state.engine.connect() as conn:
        if backend == "postgres":
            conn.exec_driver_sql("SET enable_seqscan = off")
        plans = "\n".join(
            " ".join(str(col) for row in conn.exec_driver_sql(prefix + sql, params).all()
                     for col in row)
            for sql, params in captured)
        conn.rollback()
    for index in ("ix_verdicts_node_at", "ix_bundles_node_stored_size",
                  "ix_evidence_node_kind_at"):
        assert index in plans, plans
    if backend == "sqlite":  # the byte quota reads no table row (0007)
        assert "USING COVERING INDEX ix_bundles_node_stored_size" in plans, plans
        assert not re.search(r"\bSCAN (nodes|reputation|leases|bundles|verdicts|evidence)\b",
                             plans), plans  # SEARCH ... USING INDEX only
    else:
        assert "Seq Scan" not in plans, plans


def test_nul_characters_are_not_found_and_stored_escaped(state: SqlState) -> None:
    """Signed payloads may carry NUL, which PostgreSQL refuses in text: lookups find
    nothing, free text is stored with U+FFFD (threat model, item 9)."""
    a = add_node(state, "alice").node_id
    state.insert_leases([lease(a, 1)])
    snap = state.submission_snapshot(a, "task-000001\x00", "b" * 64, T0, T0)
    assert snap.node is not None and snap.lease is None
    assert state.submission_snapshot(a + "\x00", "task-000001", "b\x00", T0, T0).node is None
    assert state.get_lease_by_task("\x00") is None and state.get_node("\x00") is None
    assert state.bundle_owners(["\x00"]) == {} and not state.has_tokenizer("\x00")
    assert state.negative_reporters("\x00", T0) == set()
    assert state.feedback_used(a, "x\x00", T0) == (0.0, 0.0)
    assert state.list_bundles(node_prefix="\x00") == []
    with pytest.raises(FtisError):
        state.resolve_node("\x00")
    with pytest.raises(FtisError) as info:
        state.apply_evidence_many([(a + "\x00", Evidence("x", 1.0))], T0,
                                  lambda events: Recorder(events, T0))
    assert info.value.code == ErrorCode.NODE_UNKNOWN
    state.record_seen({"\x00": (T0, None)})
    event = Evidence("rejected", -1.0, "TASK_UNKNOWN: no task 'x\x00'", "r\x00", "b\x00")
    state.commit_submission(
        Verdict(a, "b" * 64, ErrorCode.TASK_UNKNOWN, "no task 'x\x00'", evidence=(event,)),
        T0, Recorder([event], T0))
    state.record_rejection(a, None, ErrorCode.TASK_UNKNOWN, "\x00", T0)
    assert [v.reason for v in rows(state, VerdictRow)] == ["no task 'x\ufffd'", "\ufffd"]
    (stored,) = state.list_evidence(a)
    assert (stored.detail, stored.reporter_node_id, stored.bundle_id) == (
        "TASK_UNKNOWN: no task 'x\ufffd'", "r\ufffd", "b\ufffd")
