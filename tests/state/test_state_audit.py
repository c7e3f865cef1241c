"""The State contract for audit-based probation (revision 0005; docs/reputation.md
"Audit-based probation"), on SQLite and PostgreSQL: audit verdicts are stored one per
(sender, reporter), the sender's ``audit_status`` is re-decided from them, and relay
pages leave senders on probation out for requesters that are not established and mark
them audit-only, same tokenizer only, for established ones. Expected values by hand."""

from __future__ import annotations

from state_records import FP_A, FP_B, T0, add_node, lease, new_bundle

from ftis.coordinator import reputation
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.state.base import AuditRelay
from ftis.coordinator.state.sql import SqlState

K2 = ReputationConfig(audit_reporters=2)


def _decide(good: int, bad: int) -> int:
    return reputation.audit_status(good, bad, K2)


def _stored(state: SqlState, owner: str, number: int, **kwargs) -> str:
    the_lease = lease(owner, number)
    state.insert_leases([the_lease])
    return state.store_bundle(new_bundle(the_lease, **kwargs), T0 + number).bundle_id


def test_new_nodes_are_pending_and_seeds_can_be_set(state: SqlState) -> None:
    a = add_node(state, "alice").node_id
    assert state.get_node(a).audit_status == reputation.AUDIT_PENDING
    assert state.set_audit_status(a, reputation.AUDIT_PASSED)
    assert state.get_node(a).audit_status == reputation.AUDIT_PASSED
    assert not state.set_audit_status("0" * 32, reputation.AUDIT_PASSED)  # unknown
    assert state.audit_reports(a) == {}


def test_capabilities_are_stored_and_replaced_on_registration(state: SqlState) -> None:
    """Revision 0006: the node's registered capabilities round-trip, and registering
    again replaces them (an older client's registration clears them)."""
    a = add_node(state, "alice", capabilities=("audit-only-relay",)).node_id
    assert state.get_node(a).capabilities == ("audit-only-relay",)
    assert add_node(state, "alice", T0 + 1).capabilities == ()
    assert state.get_node(a).capabilities == ()
    assert add_node(state, "bob").capabilities == ()


def test_record_audits_one_verdict_per_reporter_and_redecides(state: SqlState) -> None:
    s = add_node(state, "sender").node_id
    r1, r2, r3 = (add_node(state, n).node_id for n in ("r1", "r2", "r3"))
    # the first plausible verdict: 1 of 2, still pending
    assert state.record_audits(r1, {s: True}, T0 + 1, _decide) == {s: (0, 0, 0)}
    # the same reporter again: replaced, not counted twice
    assert state.record_audits(r1, {s: True}, T0 + 2, _decide) == {s: (0, 0, 0)}
    assert state.audit_reports(s) == {r1: True}
    # a second, distinct reporter: passed
    assert state.record_audits(r2, {s: True}, T0 + 3, _decide) == {s: (0, 1, 0)}
    assert state.get_node(s).audit_status == reputation.AUDIT_PASSED
    # r1 changes its mind and r3 agrees: 2 implausible, failure wins
    assert state.record_audits(r1, {s: False}, T0 + 4, _decide) == {s: (1, 0, 1)}
    assert state.record_audits(r3, {s: False}, T0 + 5, _decide) == {s: (0, -1, 2)}
    assert state.get_node(s).audit_status == reputation.AUDIT_FAILED_STATUS
    assert state.audit_reports(s) == {r1: False, r2: True, r3: False}
    # unknown senders and the reporter itself are skipped
    assert state.record_audits(r1, {"f" * 32: True, r1: True}, T0 + 6, _decide) == {}


def test_relay_of_senders_on_audit_probation(state: SqlState) -> None:
    newbie = add_node(state, "newbie").node_id                      # on probation
    old = add_node(state, "old").node_id                            # established
    other_fp = add_node(state, "other", fingerprint=FP_B).node_id   # on probation, FP_B
    reader = add_node(state, "reader").node_id
    n1 = _stored(state, newbie, 1)
    o2 = _stored(state, old, 2)
    x3 = _stored(state, other_fp, 3, fingerprint=FP_B)
    o4 = _stored(state, old, 4)
    state.set_audit_status(old, reputation.AUDIT_PASSED)
    assert state.get_node(old).bundles_accepted == 2

    def page(audit: AuditRelay | None) -> list[tuple[str, bool]]:
        got, _ = state.pull_bundles(requester_id=reader, cursor=0, limit=10,
                                    max_bytes=10**6, audit=audit)
        return [(r.bundle_id, r.audit_only) for r in got]

    # off: everything, nothing audit-only (as before)
    assert page(None) == [(n1, False), (o2, False), (x3, False), (o4, False)]
    # a requester that is not established: senders on probation left out
    assert page(AuditRelay(2, established=False, fingerprint=FP_A)) == [
        (o2, False), (o4, False)]
    # established: its own tokenizer's probation bundles, audit-only; others' not at all
    assert page(AuditRelay(2, established=True, fingerprint=FP_A)) == [
        (n1, True), (o2, False), (o4, False)]
    assert page(AuditRelay(2, established=True, fingerprint=FP_B)) == [
        (o2, False), (x3, True), (o4, False)]
    # the count still matters: "old" with 2 bundles is on probation under probation_bundles 3
    assert page(AuditRelay(3, established=True, fingerprint=FP_A)) == [
        (n1, True), (o2, True), (o4, True)]
    # zero reward variance: skipped for training, still relayed for audit
    z5 = _stored(state, newbie, 5, rewards=(1.0, 1.0))
    o6 = _stored(state, old, 6, rewards=(1.0, 1.0))
    got, _ = state.pull_bundles(requester_id=reader, cursor=4, limit=10, max_bytes=10**6,
                                skip_zero_variance=True,
                                audit=AuditRelay(2, established=True, fingerprint=FP_A))
    assert [(r.bundle_id, r.audit_only) for r in got] == [(z5, True)]
    got, _ = state.pull_bundles(requester_id=reader, cursor=4, limit=10, max_bytes=10**6,
                                skip_zero_variance=True,
                                audit=AuditRelay(2, established=False, fingerprint=FP_A))
    assert got == [] and o6
    # a passed audit of the newbie: relayed to all, for training (count 2 >= 1)
    state.set_audit_status(newbie, reputation.AUDIT_PASSED)
    assert page(AuditRelay(1, established=False, fingerprint=FP_A)) == [
        (n1, False), (o2, False), (o4, False), (z5, False), (o6, False)]
