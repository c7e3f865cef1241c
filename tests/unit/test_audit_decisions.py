"""Audit-based probation, the pure decisions (docs/reputation.md "Audit-based
probation"): who is on probation and established, what one reporter's feedback entry
judges, and when k verdicts pass or fail a sender. Expected values computed by hand."""

from __future__ import annotations

import pytest

from ftis.coordinator import reputation as rep
from ftis.coordinator.handlers.feedback import audit_verdicts
from ftis.coordinator.reputation import FeedbackEntry, ReputationConfig, Standing
from ftis.coordinator.state.base import NodeRecord

OFF = ReputationConfig()
K2 = ReputationConfig(audit_reporters=2, reporter_maturity_s=0)
PENDING, PASSED, FAILED = rep.AUDIT_PENDING, rep.AUDIT_PASSED, rep.AUDIT_FAILED_STATUS


def test_off_by_default_and_validated() -> None:
    assert OFF.audit_reporters == 0
    with pytest.raises(ValueError, match="audit_reporters"):
        ReputationConfig(audit_reporters=-1)
    with pytest.raises(ValueError, match="audit_reporters"):
        ReputationConfig(audit_reporters=65)
    assert ReputationConfig.from_dict({"audit_reporters": 3}).audit_reporters == 3


def test_probation_is_the_count_when_off_and_count_plus_audit_when_on() -> None:
    # off: exactly the old rule, whatever the audit column holds
    assert rep.in_probation(4, PASSED, OFF) and not rep.in_probation(5, PENDING, OFF)
    assert not rep.in_probation(5, FAILED, OFF)
    # on: both the count and a passed audit
    assert rep.in_probation(5, PENDING, K2) and rep.in_probation(5, FAILED, K2)
    assert rep.in_probation(4, PASSED, K2) and not rep.in_probation(5, PASSED, K2)
    # the quarantine threshold stays on the count alone
    assert rep.threshold(5, K2) == K2.quarantine_threshold
    assert rep.threshold(4, K2) == K2.probation_threshold


def test_established_needs_probation_over_and_no_quarantine_or_ban() -> None:
    assert rep.established(5, PASSED, False, False, K2)
    assert not rep.established(5, PENDING, False, False, K2)
    assert not rep.established(5, PASSED, True, False, K2)
    assert not rep.established(5, PASSED, False, True, K2)
    assert rep.established(5, PENDING, False, False, OFF)


def test_reporter_factor_is_zero_until_the_reporters_own_audit_passed() -> None:
    s = Standing()
    assert rep.reporter_factor(s, 10, 0, 1000, K2, audit=PENDING) == 0.0
    assert rep.reporter_factor(s, 10, 0, 1000, K2, audit=FAILED) == 0.0
    assert rep.reporter_factor(s, 10, 0, 1000, K2, audit=PASSED) == 1.0
    # off: the audit is not read (the old default argument)
    assert rep.reporter_factor(s, 10, 0, 1000, ReputationConfig(reporter_maturity_s=0),
                               audit=PENDING) == 1.0


def _entry(mean: float = -0.2, completions: int = 8, stderr: float = 0.05,
           filtered: float = 0.0, sender: str = "s", **kw) -> FeedbackEntry:
    return FeedbackEntry(sender_id=sender, mean_log_ratio=mean, log_ratio_completions=completions,
                         log_ratio_stderr=stderr, filtered_frac=filtered, tokens=10, **kw)


def test_audit_judgement_is_the_feedback_plausibility_rule_on_log_ratios() -> None:
    assert rep.audit_judgement(_entry(), K2) is True
    assert rep.audit_judgement(_entry(mean=-1.5), K2) is True       # at the tolerance
    assert rep.audit_judgement(_entry(mean=-1.51), K2) is False     # beyond it
    # the fabricated constant -0.7 per token against a near-uniform model: about -5 nats
    assert rep.audit_judgement(_entry(mean=-5.0), K2) is False
    assert rep.audit_judgement(_entry(filtered=0.6), K2) is False   # > filtered_frac_limit
    # shading by ln 2: 0.693 - 3 x 0.01 = 0.663 > 0.05 with 12 completions
    assert rep.audit_judgement(_entry(mean=0.693, stderr=0.01, completions=12), K2) is False
    # no token-aligned statistic: no judgement, either way
    assert rep.audit_judgement(_entry(completions=0), K2) is None
    assert rep.audit_judgement(_entry(mean=-9.0, completions=0), K2) is None
    # text and invalid-bundle claims are not audit verdicts (the coordinator checks text)
    assert rep.audit_judgement(_entry(text_mismatches=2), K2) is True


def test_audit_status_k_agreeing_reporters_failure_wins() -> None:
    table = {(0, 0): PENDING, (1, 0): PENDING, (2, 0): PASSED, (3, 1): PASSED,
             (2, 1): PASSED, (1, 1): PENDING, (0, 2): FAILED, (1, 2): FAILED,
             (2, 2): FAILED, (5, 2): FAILED}
    for (good, bad), want in table.items():
        assert rep.audit_status(good, bad, K2) == want, (good, bad)
    k3 = ReputationConfig(audit_reporters=3)
    assert rep.audit_status(2, 0, k3) == PENDING and rep.audit_status(3, 2, k3) == PASSED
    assert rep.audit_status(0, 0, OFF) == PASSED  # off: everybody passes


def test_a_passed_spot_check_passes_a_pending_audit_only() -> None:
    # the coordinator's own recomputation with the held weights: a pending audit passes
    assert rep.audit_passed_by_spot_check(PENDING, True, K2)
    # not checked (not drawn, or the card is not held): nothing
    assert not rep.audit_passed_by_spot_check(PENDING, False, K2)
    # a failed audit stays failed; a passed one needs nothing; off: nothing to pass
    assert not rep.audit_passed_by_spot_check(FAILED, True, K2)
    assert not rep.audit_passed_by_spot_check(PASSED, True, K2)
    assert not rep.audit_passed_by_spot_check(PENDING, True, OFF)


def test_audit_without_any_bootstrap_is_a_problem_and_any_one_bootstrap_is_enough() -> None:
    problem = rep.audit_bootstrap_problem(K2, seed_nodes=0, holds_cards=False, passed_audits=0)
    assert problem is not None and "audit_reporters = 2" in problem
    assert "\n" not in problem  # one line: it is an exit message and an error reason
    assert rep.audit_bootstrap_problem(K2, 1, False, 0) is None  # an operator's seed
    assert rep.audit_bootstrap_problem(K2, 0, True, 0) is None  # a held card
    assert rep.audit_bootstrap_problem(K2, 0, False, 1) is None  # a node already passed
    assert rep.audit_bootstrap_problem(OFF, 0, False, 0) is None  # the rule is off


def test_audit_failed_evidence_is_heavy_enough_to_quarantine_a_new_node() -> None:
    ev = rep.audit_failed_evidence("s" * 40, 2)
    assert (ev.kind, ev.weight) == (rep.AUDIT_FAILED, -4.0) and "2 established" in ev.detail
    # a new node with 2 verified bundles: E = (2 + 1) / (2 + 4 + 2) = 0.375 < the
    # probation threshold 0.45: quarantined by the audit failure alone
    after = rep.apply(Standing(good=2.0), [ev], 0, 2, K2)
    assert after.quarantined and rep.score(after.good, after.bad) == pytest.approx(3 / 8)


def _node(node_id: str, bundles: int, audit: int, fingerprint: str = "f") -> NodeRecord:
    return NodeRecord(node_id=node_id, public_key=b"", display_name="", model_card=b"",
                      fingerprint=fingerprint, vocab_size=10, client_version="",
                      registered_at_ms=0, last_seen_ms=0, policy_version=0, banned=False,
                      ban_reason="", bundles_accepted=bundles, bundles_rejected=0,
                      reward_mismatches=0, completions=0, completion_tokens=0,
                      audit_status=audit)


def test_audit_verdicts_only_for_senders_on_probation_with_counted_bundles() -> None:
    senders = {"new": _node("new", 2, PENDING), "old": _node("old", 9, PASSED),
               "bad": _node("bad", 3, PENDING), "quiet": _node("quiet", 1, PENDING),
               "uncounted": _node("uncounted", 1, PENDING), "gone": None,
               "foreign": _node("foreign", 1, PENDING, fingerprint="g")}
    entries = [_entry(sender="new"), _entry(sender="old"), _entry(sender="bad", mean=-5.0),
               _entry(sender="quiet", completions=0), _entry(sender="uncounted"),
               _entry(sender="gone"), _entry(sender="foreign")]
    counted = [["b1"], ["b2"], ["b3"], ["b4"], [], ["b6"], ["b8"]]
    assert audit_verdicts(entries, counted, senders, "f", K2) == {"new": True, "bad": False}
    # a reporter of another tokenizer judges only that tokenizer's senders
    assert audit_verdicts(entries, counted, senders, "g", K2) == {"foreign": True}
    # a later entry about the same sender wins
    assert audit_verdicts([_entry(sender="new"), _entry(sender="new", mean=-3.0)],
                          [["b1"], ["b7"]], senders, "f", K2) == {"new": False}
