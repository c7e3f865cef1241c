"""The State contract, part 1: the methods the coordinator used before issue 12 (nodes,
leases, bundles, tokenizers, reputation, settings, metrics, stats), on SQLite and
PostgreSQL. Part 2 (the submit path, leases in blocks, concurrency) is
test_state_submit.py. Expected values are computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
from state_records import (
    FP_A,
    FP_B,
    T0,
    add_node,
    apply_evidence,
    lease,
    new_bundle,
    node_id,
    rows,
)

from ftis.coordinator import reputation
from ftis.coordinator.reputation import Evidence, ReputationConfig
from ftis.coordinator.state.base import BranchRecord
from ftis.coordinator.state.sql import SqlState, VerdictRow, dump_tables
from ftis.protocol.errors import ErrorCode, FtisError

# -- nodes ---------------------------------------------------------------------------


def test_upsert_inserts_then_updates_card_name_and_last_seen(state: SqlState) -> None:
    first = add_node(state, "alice", now_ms=T0)
    assert first.node_id == node_id("alice")
    assert (first.public_key, first.display_name, first.model_card) == (
        b"pk-alice", "alice", b"card-alice")
    assert (first.fingerprint, first.vocab_size, first.client_version) == (FP_A, 1000, "test")
    assert (first.registered_at_ms, first.last_seen_ms, first.policy_version) == (T0, T0, 0)
    assert (first.banned, first.ban_reason) == (False, "")
    assert (first.bundles_accepted, first.bundles_rejected, first.reward_mismatches) == (0, 0, 0)
    assert (first.completions, first.completion_tokens) == (0, 0)
    assert (first.rep_good, first.rep_bad, first.rep_updated_ms, first.quarantined) == (
        0.0, 0.0, T0, False)
    assert first.latest_metrics == {} and first.latest_metrics_step == 0

    state.set_ban(first.node_id, True, "spam")
    again = add_node(state, "alice", now_ms=T0 + 5, fingerprint=FP_B, display_name="Alice 2")
    assert (again.display_name, again.fingerprint, again.last_seen_ms) == ("Alice 2", FP_B, T0 + 5)
    assert again.registered_at_ms == T0
    assert (again.banned, again.ban_reason) == (True, "spam")  # ban untouched
    assert state.get_node(first.node_id) == again


def test_get_node_unknown(state: SqlState) -> None:
    assert state.get_node(node_id("nobody")) is None


def test_resolve_node_by_id_and_unique_prefix(state: SqlState) -> None:
    a = add_node(state, "alice")
    b = add_node(state, "bob")
    assert state.resolve_node(a.node_id) == a
    # the shortest prefix that tells them apart
    n = next(i for i in range(1, 64) if a.node_id[:i] != b.node_id[:i])
    assert state.resolve_node(a.node_id[:n]) == a
    assert state.resolve_node(b.node_id[:n]) == b
    with pytest.raises(FtisError) as info:
        state.resolve_node("")
    assert info.value.code == ErrorCode.NODE_UNKNOWN
    with pytest.raises(FtisError, match="no node"):
        state.resolve_node("zz")  # ids are hex
    with pytest.raises(FtisError, match="no node"):
        state.resolve_node("_")  # LIKE wildcards are escaped
    with pytest.raises(FtisError, match="no node"):
        state.resolve_node("%")


def test_resolve_node_ambiguous_prefix(state: SqlState) -> None:
    ids = [add_node(state, f"n{i}").node_id for i in range(40)]
    first_chars = [i[0] for i in ids]
    shared = next(c for c in first_chars if first_chars.count(c) > 1)  # 40 ids, 16 digits
    with pytest.raises(FtisError, match="several nodes"):
        state.resolve_node(shared)


def test_list_nodes_oldest_registration_first(state: SqlState) -> None:
    add_node(state, "late", now_ms=T0 + 20)
    add_node(state, "early", now_ms=T0)
    add_node(state, "middle", now_ms=T0 + 10)
    assert [n.display_name for n in state.list_nodes()] == ["early", "middle", "late"]


def test_set_ban_and_unban(state: SqlState) -> None:
    a = add_node(state, "alice")
    banned = state.set_ban(a.node_id, True, "proof: TEXT_MISMATCH")
    assert (banned.banned, banned.ban_reason) == (True, "proof: TEXT_MISMATCH")
    unbanned = state.set_ban(a.node_id, False, "ignored")
    assert (unbanned.banned, unbanned.ban_reason) == (False, "")
    with pytest.raises(FtisError) as info:
        state.set_ban(node_id("ghost"), True)
    assert info.value.code == ErrorCode.NODE_UNKNOWN


# -- leases ----------------------------------------------------------------------------


def test_insert_and_get_leases(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    leases = [lease(a, 1), lease(a, 2, dataset="basic_arithmetic", spec_index=1)]
    state.insert_leases(leases)
    assert state.get_lease_by_task("task-000001") == leases[0]
    got = state.get_lease_by_task("task-000002")
    assert got == leases[1] and got.entry.metadata == {"i": 2} and got.bundle_id is None
    assert state.get_lease_by_task("task-999999") is None


def test_count_outstanding_leases(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    b = add_node(state, "bob").node_id
    state.insert_leases([lease(a, 1, ttl_ms=100), lease(a, 2, ttl_ms=1000), lease(b, 3)])
    assert state.count_outstanding_leases(a, T0) == 2
    assert state.count_outstanding_leases(a, T0 + 100) == 2  # deadline >= now: still out
    assert state.count_outstanding_leases(a, T0 + 101) == 1
    assert state.count_outstanding_leases(None, T0) == 3
    state.store_bundle(new_bundle(lease(a, 2, ttl_ms=1000)), T0 + 1)
    assert state.count_outstanding_leases(a, T0) == 1  # answered leases do not count
    assert state.count_outstanding_leases(node_id("ghost"), T0) == 0


# -- bundles -----------------------------------------------------------------------------


def test_store_bundle(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    the_lease = lease(a, 1)
    state.insert_leases([the_lease])
    bundle = new_bundle(the_lease, mismatches=1, size_bytes=321, text_verified=True)
    record = state.store_bundle(bundle, T0 + 50)
    assert record.sequence == 1
    assert (record.bundle_id, record.node_id, record.task_id, record.lease_id) == (
        bundle.bundle_id, a, "task-000001", "lease-000001")
    assert (record.dataset, record.fingerprint, record.envelope) == (
        "chain_sum", FP_A, bundle.envelope)
    assert record.verified_rewards == [1.0, 0.0, 1.0, 0.0]
    assert (record.mean_reward, record.zero_variance, record.completions) == (0.5, False, 4)
    assert (record.completion_tokens, record.size_bytes, record.reward_mismatches) == (24, 321, 1)
    assert (record.policy_version, record.stored_at_ms, record.text_verified) == (3, T0 + 50, True)
    assert state.get_lease_by_task("task-000001").bundle_id == bundle.bundle_id
    node = state.get_node(a)
    assert (node.bundles_accepted, node.reward_mismatches, node.completions) == (1, 1, 4)
    assert (node.completion_tokens, node.last_seen_ms, node.policy_version) == (24, T0 + 50, 3)
    verdicts = rows(state, VerdictRow)
    assert [(v.node_id, v.bundle_id, v.code, v.reason, v.at_ms) for v in verdicts] == [
        (a, bundle.bundle_id, 0, "accepted; 1 reward mismatches", T0 + 50)]


def test_store_bundle_replay_writes_nothing(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    the_lease = lease(a, 1)
    state.insert_leases([the_lease, lease(a, 2)])
    state.store_bundle(new_bundle(the_lease), T0)
    before = dump_tables(state, ("nodes", "leases", "bundles", "verdicts"))
    for bundle in (new_bundle(the_lease, tag="other"),  # same lease, other payload
                   new_bundle(the_lease)):  # byte-identical
        with pytest.raises(FtisError) as info:
            state.store_bundle(bundle, T0 + 1)
        assert info.value.code == ErrorCode.BUNDLE_REPLAYED
    # same payload id on another lease: the unique bundle_id
    dup = new_bundle(lease(a, 2))
    dup = dataclasses.replace(dup, bundle_id=new_bundle(the_lease).bundle_id)
    with pytest.raises(FtisError) as info:
        state.store_bundle(dup, T0 + 1)
    assert info.value.code == ErrorCode.BUNDLE_REPLAYED
    assert dump_tables(state, ("nodes", "leases", "bundles", "verdicts")) == before


def test_record_rejection_counts(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    before = dump_tables(state)
    state.record_rejection(a, "b1", ErrorCode.SIGNATURE_INVALID, "bad sig", T0)
    state.record_rejection(a, None, ErrorCode.LEASE_EXPIRED, "late", T0)
    state.record_rejection(a, None, ErrorCode.LEASE_EXPIRED, "late", T0)
    state.record_rejection(None, None, ErrorCode.PAYLOAD_MALFORMED, "junk", T0)
    state.record_rejection(node_id("ghost"), None, ErrorCode.NODE_UNKNOWN, "who", T0)
    assert dump_tables(state) == before  # nodes, leases and bundles unchanged
    assert state.get_node(a).bundles_rejected == 3
    assert state.rejections_by_code(a) == {int(ErrorCode.SIGNATURE_INVALID): 1,
                                           int(ErrorCode.LEASE_EXPIRED): 2}
    assert state.rejections_by_code() == {
        int(ErrorCode.SIGNATURE_INVALID): 1, int(ErrorCode.LEASE_EXPIRED): 2,
        int(ErrorCode.PAYLOAD_MALFORMED): 1, int(ErrorCode.NODE_UNKNOWN): 1}
    assert state.stats(T0, 1000).bundles_rejected == 5


def _stored(state: SqlState, owner: str, number: int, **kwargs) -> str:
    the_lease = lease(owner, number)
    state.insert_leases([the_lease])
    return state.store_bundle(new_bundle(the_lease, **kwargs), T0 + number).bundle_id


def test_pull_bundles_filters_and_pages(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    b = add_node(state, "bob", fingerprint=FP_B).node_id
    c = add_node(state, "carol").node_id
    reader = add_node(state, "reader").node_id
    a1 = _stored(state, a, 1, size_bytes=100)                        # seq 1
    _stored(state, b, 2, size_bytes=100, fingerprint=FP_B)           # seq 2
    a3 = _stored(state, a, 3, size_bytes=100, rewards=(1.0, 1.0))    # seq 3, zero variance
    c4 = _stored(state, c, 4, size_bytes=100)                        # seq 4
    r5 = _stored(state, reader, 5, size_bytes=100)                   # seq 5, own
    assert r5

    page, cursor = state.pull_bundles(requester_id=reader, cursor=0, limit=10, max_bytes=10**6)
    assert [r.sequence for r in page] == [1, 2, 3, 4] and cursor == 5
    assert page[0].bundle_id == a1 and page[0].question == "What is 1 + 1?"
    assert page[0].sender_standing == reputation.Standing(0.0, 0.0, T0)
    page, cursor = state.pull_bundles(requester_id=reader, cursor=0, limit=10, max_bytes=10**6,
                                      fingerprint=FP_A, skip_zero_variance=True)
    assert [r.bundle_id for r in page] == [a1, c4] and cursor == 5
    # page limits: count, then bytes (the first bundle always fits)
    page, cursor = state.pull_bundles(requester_id=reader, cursor=0, limit=2, max_bytes=10**6)
    assert [r.sequence for r in page] == [1, 2] and cursor == 2
    page, cursor = state.pull_bundles(requester_id=reader, cursor=1, limit=10, max_bytes=150)
    assert [r.sequence for r in page] == [2] and cursor == 2
    page, cursor = state.pull_bundles(requester_id=reader, cursor=0, limit=10, max_bytes=1)
    assert [r.sequence for r in page] == [1] and cursor == 1
    page, cursor = state.pull_bundles(requester_id=reader, cursor=5, limit=10, max_bytes=10**6)
    assert page == [] and cursor == 5
    # banned and quarantined senders are not relayed
    state.set_ban(b, True, "x")
    apply_evidence(state, c, [Evidence("rejected", -10.0)], T0 + 10, ReputationConfig())
    assert state.get_node(c).quarantined
    page, _ = state.pull_bundles(requester_id=reader, cursor=0, limit=10, max_bytes=10**6)
    assert [r.bundle_id for r in page] == [a1, a3]


def _envelope_reads(state: SqlState) -> list[str]:
    """Records every statement of ``state`` that selects the envelope column."""
    from sqlalchemy import event

    seen: list[str] = []

    @event.listens_for(state.engine, "before_cursor_execute")
    def _count(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "envelope" in statement:
            seen.append(statement)

    return seen


def test_relayed_envelopes_are_read_once_per_process(state: SqlState, state_url: str,
                                                     backend: str) -> None:
    """With an envelope cache the page query never selects envelopes; each process reads
    a bundle's envelope from the database on its first relay only
    (:mod:`.envelope_cache`). Without one (SQLite's default) the page query reads them.
    Every relay carries the stored bytes."""
    a = add_node(state, "alice").node_id
    reader = add_node(state, "reader").node_id
    other = add_node(state, "other").node_id
    ids = [_stored(state, a, n) for n in (1, 2, 3)]
    want = [b"envelope:" + i.encode() for i in ids]
    cached = SqlState(state_url, envelope_cache_bytes=10**6)
    try:
        reads = _envelope_reads(cached)
        page, _ = cached.pull_bundles(requester_id=reader, cursor=0, limit=2, max_bytes=10**6)
        assert [r.envelope for r in page] == want[:2] and len(reads) == 1
        assert "IN" in reads[0] and "entry_json" not in reads[0]
        page, _ = cached.pull_bundles(requester_id=other, cursor=0, limit=10,
                                      max_bytes=10**6)
        assert [r.envelope for r in page] == want and len(reads) == 2  # the third only
        page, _ = cached.pull_bundles(requester_id=reader, cursor=0, limit=10,
                                      max_bytes=10**6)
        assert [r.envelope for r in page] == want and len(reads) == 2  # all from memory
    finally:
        cached.close()
    # the default: a cache on PostgreSQL, none on SQLite; and one that keeps nothing
    for opened, per_pull in ((state, 0 if backend == "postgres" else 1),
                             (SqlState(state_url, envelope_cache_bytes=0), 1)):
        reads = _envelope_reads(opened)
        for _ in range(2):
            page, _ = opened.pull_bundles(requester_id=reader, cursor=0, limit=10,
                                          max_bytes=10**6)
            assert [r.envelope for r in page] == want
        assert len(reads) == (1 if per_pull == 0 else 2)
        if per_pull:
            assert all("entry_json" in r for r in reads)  # the page query itself
        if opened is not state:
            opened.close()
    with pytest.raises(ValueError, match="< 0"):
        SqlState(state_url, envelope_cache_bytes=-1)


def test_bundle_stored_while_quarantined_is_never_relayed(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    reader = add_node(state, "reader").node_id
    apply_evidence(state, a, [Evidence("rejected", -10.0)], T0, ReputationConfig())
    _stored(state, a, 1)
    state.reset_bad_evidence(a, T0 + 5)  # released
    assert not state.get_node(a).quarantined
    later = _stored(state, a, 2)
    page, _ = state.pull_bundles(requester_id=reader, cursor=0, limit=10, max_bytes=10**6)
    assert [r.bundle_id for r in page] == [later]


def test_list_bundles_owners_and_text_verification(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    b = add_node(state, "bob").node_id
    a1 = _stored(state, a, 1, text_verified=True)
    b2 = _stored(state, b, 2)
    a3 = _stored(state, a, 3)
    assert [r.bundle_id for r in state.list_bundles()] == [a3, b2, a1]
    assert [r.bundle_id for r in state.list_bundles(limit=2)] == [a3, b2]
    assert [r.bundle_id for r in state.list_bundles(node_prefix=a[:12])] == [a3, a1]
    assert state.list_bundles(node_prefix="_") == []
    assert state.bundle_owners([a1, b2, "nope", a1]) == {a1: (a, True, 1), b2: (b, False, 2)}
    assert state.bundle_owners([]) == {}
    got = state.get_bundle(b2)
    assert got is not None and (got.bundle_id, got.node_id, got.sequence) == (b2, b, 2)
    assert got == state.list_bundles(node_prefix=b)[0]
    assert state.get_bundle("nope") is None and state.get_bundle("\x00") is None
    assert state.count_text_unverified(a) == (2, 1)
    assert state.count_text_unverified(node_id("ghost")) == (0, 0)


# -- tokenizers ------------------------------------------------------------------------


def test_tokenizers(state: SqlState) -> None:
    assert not state.has_tokenizer(FP_A) and state.get_tokenizer(FP_A) is None
    assert state.store_tokenizer(FP_A, b"\x1f\x8bgz", 1000, "uploader", T0) is True
    assert state.store_tokenizer(FP_A, b"other", 5, "someone", T0 + 1) is False
    assert state.has_tokenizer(FP_A) and state.get_tokenizer(FP_A) == b"\x1f\x8bgz"
    assert not state.has_tokenizer(FP_B)


# -- reputation ----------------------------------------------------------------------------


def test_apply_evidence_with_the_real_policy(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    cfg = ReputationConfig(half_life_s=10.0)
    got = apply_evidence(state, a, [Evidence("bundle_verified", 1.0, "ok", "", "b1")], T0, cfg)
    assert (got.rep_good, got.rep_bad, got.rep_updated_ms, got.quarantined) == (1.0, 0.0, T0,
                                                                                 False)
    # 10 s later (one half-life): good 1 -> 0.5, then -2 bad: score 1.5/4.5 = 0.33 < 0.45
    got = apply_evidence(state, a, [Evidence("reward_mismatch", -2.0, "liar")], T0 + 10_000, cfg)
    assert math.isclose(got.rep_good, 0.5) and math.isclose(got.rep_bad, 2.0)
    assert (got.rep_updated_ms, got.quarantined) == (T0 + 10_000, True)
    with pytest.raises(FtisError) as info:
        apply_evidence(state, node_id("ghost"), [], T0, cfg)
    assert info.value.code == ErrorCode.NODE_UNKNOWN
    evidence = state.list_evidence(a)
    assert [(e.kind, e.weight, e.detail, e.at_ms) for e in evidence] == [
        ("reward_mismatch", -2.0, "liar", T0 + 10_000), ("bundle_verified", 1.0, "ok", T0)]
    assert evidence[1].bundle_id == "b1" and evidence[0].id > evidence[1].id
    assert len(state.list_evidence(a, limit=1)) == 1


def test_negative_reporters_and_feedback_used(state: SqlState) -> None:
    sender = add_node(state, "sender").node_id
    r1, r2, r3 = (add_node(state, f"r{i}").node_id for i in (1, 2, 3))
    cfg = ReputationConfig()
    feedback = reputation.FEEDBACK
    apply_evidence(state, sender, [
        Evidence(feedback, -0.5, reporter_node_id=r1),
        Evidence(feedback, -0.25, reporter_node_id=r1),
        Evidence(feedback, 0.5, reporter_node_id=r2),
        Evidence("rejected", -1.0, reporter_node_id=r3),  # not feedback
        Evidence(feedback, -0.5, reporter_node_id=""),     # no reporter
    ], T0, cfg)
    apply_evidence(state, sender, [Evidence(feedback, -0.5, reporter_node_id=r2)], T0 + 100, cfg)
    assert state.negative_reporters(sender, T0) == {r1, r2}
    assert state.negative_reporters(sender, T0 + 1) == {r2}
    assert state.negative_reporters(sender, T0 + 101) == set()
    assert state.feedback_used(r1, sender, T0) == (0.0, 0.75)
    assert state.feedback_used(r2, sender, T0) == (0.5, 0.5)
    assert state.feedback_used(r2, sender, T0 + 1) == (0.0, 0.5)
    assert state.feedback_used(r3, sender, T0) == (0.0, 0.0)


def test_reset_bad_evidence(state: SqlState) -> None:
    # (proof rows are written by commit_submission: test_state_submit.py)
    a = add_node(state, "alice").node_id
    apply_evidence(state, a, [Evidence("rejected", -3.0)], T0, ReputationConfig())
    assert state.get_node(a).quarantined
    reset = state.reset_bad_evidence(a, T0 + 7)
    assert (reset.rep_bad, reset.quarantined, reset.rep_good) == (0.0, False, 0.0)
    newest = state.list_evidence(a, limit=1)[0]
    assert (newest.kind, newest.weight, newest.at_ms) == (reputation.OPERATOR_RESET, 0.0, T0 + 7)
    assert newest.detail == "operator unban: bad evidence 3 reset to 0"
    with pytest.raises(FtisError):
        state.reset_bad_evidence(node_id("ghost"), T0)


# -- settings, metrics, stats -------------------------------------------------------------


def test_settings(state: SqlState) -> None:
    assert state.get_setting("reputation") is None
    state.put_setting("reputation", '{"a": 1}', T0)
    state.put_setting("reputation", '{"a": 2}', T0 + 1)
    assert state.get_setting("reputation") == '{"a": 2}'


def test_record_metrics(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    state.record_metrics(a, 3, {"loss": 0.5, "bad": float("nan"), "big": float("inf")}, T0 + 9)
    got = state.get_node(a)
    assert got.latest_metrics_step == 3 and got.last_seen_ms == T0 + 9
    assert got.latest_metrics["loss"] == 0.5 and math.isnan(got.latest_metrics["bad"])
    assert got.latest_metrics["big"] == float("inf")


def test_stats(state: SqlState) -> None:
    a = add_node(state, "alice", now_ms=T0).node_id
    b = add_node(state, "bob", now_ms=T0 - 10_000).node_id
    c = add_node(state, "carol", now_ms=T0).node_id
    state.set_ban(b, True, "x")
    apply_evidence(state, c, [Evidence("rejected", -10.0)], T0, ReputationConfig())
    _stored(state, a, 1, size_bytes=100, rewards=(1.0, 0.0))             # 2 completions
    _stored(state, a, 2, size_bytes=50, rewards=(1.0, 1.0, 1.0, 0.0))    # 4 completions
    state.insert_leases([lease(a, 3)])
    state.record_rejection(a, None, ErrorCode.LEASE_EXPIRED, "late", T0)
    got = state.stats(T0, active_window_ms=5_000)
    assert (got.nodes, got.active_nodes, got.banned_nodes, got.quarantined_nodes) == (3, 2, 1, 1)
    assert (got.leases_outstanding, got.bundles_accepted, got.bundles_rejected) == (1, 2, 1)
    assert (got.completions, got.completion_tokens, got.bundle_bytes) == (6, 36, 150)
    assert math.isclose(got.mean_verified_reward, (1.0 + 3.0) / 6)
    assert got.rejections_by_code == {int(ErrorCode.LEASE_EXPIRED): 1}


# -- MERIT branches (issue 16) ---------------------------------------------------------


def _b(name: str, *families: str, tokens: float = 0.0) -> BranchRecord:
    return BranchRecord(name=name, families=families, tokens=tokens)


def _shape(state: SqlState) -> list[tuple]:
    return [(b.name, b.families, b.tokens, b.node_ids, b.bundles_accepted)
            for b in state.list_branches()]


def test_define_and_list_branches(state: SqlState) -> None:
    assert state.list_branches() == []
    got = state.define_branches([_b("b1", "products", tokens=1153.0),
                                 _b("b0", "chain_sum", "gcd", tokens=2178.0)], T0)
    assert got == state.list_branches()
    assert [(b.name, b.families, b.tokens, b.defined_at_ms) for b in got] == [
        ("b0", ("chain_sum", "gcd"), 2178.0, T0), ("b1", ("products",), 1153.0, T0)]
    assert all(b.node_ids == () and b.bundles_accepted == 0 for b in got)
    # without replace, other branches stay; a family may join a free branch
    state.define_branches([_b("b2", "letter_counting")], T0 + 1)
    assert [b.name for b in state.list_branches()] == ["b0", "b1", "b2"]


@pytest.mark.parametrize("branches", [
    [_b("b0", "chain_sum"), _b("b1", "chain_sum")],       # one family in two branches
    [_b("b0", "gcd", "gcd")],                             # named twice in one
    [_b("b9", "products")],                               # products is b1's (kept)
    [_b("b0", "chain_sum"), _b("b0", "gcd")],             # a name twice
    [_b("b3")],                                           # no family
    [_b("", "leg_counting")], [_b("b 3", "leg_counting")], [_b("x" * 65, "leg_counting")],
    [_b("b3", "leg_counting", tokens=-1.0)], [_b("b3", "leg_counting", tokens=math.nan)],
])
def test_invalid_branches_are_refused_and_write_nothing(state: SqlState, branches) -> None:
    state.define_branches([_b("b0", "chain_sum", "gcd"), _b("b1", "products")], T0)
    before = dump_tables(state, ("branches", "nodes"))
    with pytest.raises(FtisError) as info:
        state.define_branches(branches, T0 + 1)
    assert info.value.code == ErrorCode.BRANCH_INVALID and info.value.reason
    assert dump_tables(state, ("branches", "nodes")) == before


def test_replace_drops_other_branches_and_unassigns_their_nodes(state: SqlState) -> None:
    a, b = add_node(state, "alice").node_id, add_node(state, "bob", now_ms=T0 + 1).node_id
    state.define_branches([_b("b0", "chain_sum", "gcd"), _b("b1", "products")], T0)
    state.assign_branches({a: "b0", b: "b1"})
    # b0 redefined (its node stays), b1 dropped (its node unassigned); products may
    # move to b0 since b1 goes in the same call
    got = state.define_branches([_b("b0", "chain_sum", "products", tokens=5.0)], T0 + 7,
                                replace=True)
    assert [(x.name, x.families, x.tokens, x.defined_at_ms, x.node_ids) for x in got] == [
        ("b0", ("chain_sum", "products"), 5.0, T0 + 7, (a,))]
    assert state.get_node(a).branch == "b0" and state.get_node(b).branch is None


def test_assign_and_unassign_nodes(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    b = add_node(state, "bob", now_ms=T0 + 1).node_id
    c = add_node(state, "carol", now_ms=T0 + 2).node_id
    assert state.get_node(a).branch is None  # new nodes: the whole mix
    state.define_branches([_b("b0", "chain_sum"), _b("b1", "products")], T0)
    got = state.assign_branches({b: "b1", a: "b0", c: "b0"})
    assert [(n.node_id, n.branch) for n in got] == [(b, "b1"), (a, "b0"), (c, "b0")]
    assert got[0] == state.get_node(b)
    assert [(x.name, x.node_ids) for x in state.list_branches()] == [
        ("b0", (a, c)), ("b1", (b,))]  # oldest registration first
    # every node read carries it; re-registering keeps it
    assert {n.node_id: n.branch for n in state.list_nodes()} == {a: "b0", b: "b1", c: "b0"}
    assert state.resolve_node(a[:20]).branch == "b0"
    assert add_node(state, "alice", now_ms=T0 + 9).branch == "b0"
    (unassigned,) = state.assign_branches({c: None})
    assert unassigned.branch is None and state.get_node(c).branch is None
    assert state.assign_branches({}) == []


def test_assign_with_an_unknown_node_or_branch_writes_nothing(state: SqlState) -> None:
    a, b = add_node(state, "alice").node_id, add_node(state, "bob").node_id
    state.define_branches([_b("b0", "chain_sum")], T0)
    state.assign_branches({b: "b0"})
    before = dump_tables(state, ("branches", "nodes"))
    for assignments, code in [({a: "b0", node_id("ghost"): "b0"}, ErrorCode.NODE_UNKNOWN),
                              ({a: "b0", b: "nope"}, ErrorCode.BRANCH_UNKNOWN),
                              ({a: "b\x000"}, ErrorCode.BRANCH_UNKNOWN),
                              ({"\x00": None}, ErrorCode.NODE_UNKNOWN)]:
        with pytest.raises(FtisError) as info:
            state.assign_branches(assignments)
        assert info.value.code == code, assignments
    assert dump_tables(state, ("branches", "nodes")) == before


def test_leases_carry_their_branch_and_answered_ones_count_per_branch(state: SqlState) -> None:
    a, b = add_node(state, "alice").node_id, add_node(state, "bob").node_id
    state.define_branches([_b("b0", "chain_sum"), _b("b1", "products")], T0)
    l1 = dataclasses.replace(lease(a, 1), branch="b0")
    l2 = dataclasses.replace(lease(a, 2), branch="b0")
    l3 = dataclasses.replace(lease(b, 3, dataset="products"), branch="b1")
    l4 = lease(b, 4)  # issued from the whole mix
    state.insert_leases([l1, l2, l3, l4])
    assert state.get_lease_by_task(l1.task_id) == l1 and l1.branch == "b0"
    assert state.get_lease_by_task(l4.task_id).branch is None
    snap = state.submission_snapshot(a, l2.task_id, "0" * 64, T0, T0)
    assert snap.lease == l2
    for x in (l1, l3, l4):
        state.store_bundle(new_bundle(x), T0 + 1)
    # l2 unanswered: not counted; l4 answered but branchless
    assert _shape(state) == [("b0", ("chain_sum",), 0.0, (), 1),
                             ("b1", ("products",), 0.0, (), 1)]
    state.assign_branches({a: "b0"})
    # without detail: the definitions only (the lease path's cache)
    assert [(x.name, x.families, x.node_ids, x.bundles_accepted)
            for x in state.list_branches(detail=False)] == [
        ("b0", ("chain_sum",), (), 0), ("b1", ("products",), (), 0)]
    # the lease_block path stores the branch too
    got = state.lease_block(a, 2, T0, 10, lambda start: [
        dataclasses.replace(lease(a, n), branch="b1") for n in range(start + 100, start + 102)])
    assert [state.get_lease_by_task(x.task_id).branch for x in got] == ["b1", "b1"]


def test_pull_bundles_of_a_branch_are_its_leases_only(state: SqlState) -> None:
    """MERIT branches train without communication: a branch's relay page holds only the
    bundles whose lease was issued under that branch (the lease's branch, not the
    sender's current one); without a branch, every bundle as before."""
    a, b = add_node(state, "alice").node_id, add_node(state, "bob").node_id
    reader = add_node(state, "reader").node_id
    state.define_branches([_b("b0", "chain_sum"), _b("b1", "products")], T0)
    in_b0 = dataclasses.replace(lease(a, 1), branch="b0")
    in_b1 = dataclasses.replace(lease(b, 2, dataset="products"), branch="b1")
    whole = lease(b, 3)                                  # issued from the whole mix
    later_b0 = dataclasses.replace(lease(b, 4), branch="b0")
    state.insert_leases([in_b0, in_b1, whole, later_b0])
    for x in (in_b0, in_b1, whole, later_b0):           # sequences 1, 2, 3, 4
        state.store_bundle(new_bundle(x), T0 + 1)
    state.assign_branches({b: "b1"})  # bob moves: his b0 bundle stays b0's

    def seqs(branch: str | None, **kw) -> tuple[list[int], int]:
        page, cursor = state.pull_bundles(requester_id=reader, cursor=kw.pop("cursor", 0),
                                          limit=kw.pop("limit", 10), max_bytes=10**6,
                                          branch=branch, **kw)
        return [r.sequence for r in page], cursor

    assert seqs("b0") == ([1, 4], 4)
    assert seqs("b1") == ([2], 4)
    assert seqs("b9") == ([], 4)            # a branch with no bundles: an empty page
    assert seqs(None) == ([1, 2, 3, 4], 4)  # unassigned: everything
    # paging within a branch: a full page stops at its last bundle
    assert seqs("b0", limit=1) == ([1], 1)
    assert seqs("b0", cursor=1) == ([4], 4)
    # combined with the other filters
    assert seqs("b0", fingerprint=FP_B) == ([], 4)
    assert seqs("b0", fingerprint=FP_A, skip_zero_variance=True) == ([1, 4], 4)
    # the requester's own bundles stay out within its branch too
    page, _ = state.pull_bundles(requester_id=a, cursor=0, limit=10, max_bytes=10**6,
                                 branch="b0")
    assert [r.sequence for r in page] == [4]
