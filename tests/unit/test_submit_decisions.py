"""Pure pieces of the submit, relay and feedback paths: relay pages written as wire bytes,
rejection decisions, and receiver feedback turned into evidence (hand-computed)."""

from __future__ import annotations

import pytest

from ftis.coordinator import reputation
from ftis.coordinator.handlers.relay import RelayPage
from ftis.coordinator.reputation import FeedbackEntry, ReputationConfig, SenderView, Standing
from ftis.coordinator.server import convert
from ftis.coordinator.state.base import BundleRecord
from ftis.v1 import bundle_pb2, swarm_pb2


def _record(seq: int, envelope: bytes) -> BundleRecord:
    return BundleRecord(
        sequence=seq, bundle_id=f"b{seq}", node_id="n", task_id="t", lease_id="l",
        dataset="chain_sum", fingerprint="f" * 64, envelope=envelope,
        verified_rewards=[1.0, 0.0], mean_reward=0.5, zero_variance=False, completions=2,
        completion_tokens=12, size_bytes=len(envelope), reward_mismatches=0, policy_version=3,
        stored_at_ms=1234, question=f"What is {seq} + 1?")


def test_relay_page_bytes_parse_as_the_response_with_envelopes_untouched():
    envelopes = [bundle_pb2.SignedEnvelope(payload_type="bundle", payload=bytes([i]) * 300,
                                           public_key=b"k" * 32, signature=b"s" * 64)
                 .SerializeToString() for i in range(3)]
    page = RelayPage([_record(i + 1, e) for i, e in enumerate(envelopes)], [0.5, 0.25, 0.9], 7)
    reply = swarm_pb2.PullBundlesResponse.FromString(convert.relay_page_bytes(page))
    assert reply.next_cursor == 7 and not reply.HasField("error")
    assert [b.sequence for b in reply.bundles] == [1, 2, 3]
    assert [b.sender_reputation for b in reply.bundles] == [0.5, 0.25, 0.9]
    assert [b.envelope.SerializeToString() for b in reply.bundles] == envelopes
    assert reply.bundles[1].task_question == "What is 2 + 1?"
    assert list(reply.bundles[0].verified_rewards) == [1.0, 0.0]


def test_relay_field_numbers_match_the_proto():
    fields = swarm_pb2.RelayedBundle.DESCRIPTOR.fields_by_name
    assert fields["envelope"].number == convert.RELAYED_ENVELOPE_FIELD
    assert swarm_pb2.PullBundlesResponse.DESCRIPTOR.fields_by_name[
        "bundles"].number == convert.PULL_BUNDLES_FIELD


def test_empty_relay_page():
    reply = swarm_pb2.PullBundlesResponse.FromString(
        convert.relay_page_bytes(RelayPage([], [], 0)))
    assert list(reply.bundles) == [] and reply.next_cursor == 0


@pytest.mark.parametrize(("code", "kind", "weight", "proof"), [
    ("TEXT_MISMATCH", reputation.TEXT_MISMATCH, -4.0, True),
    ("PROMPT_MISMATCH", reputation.PROMPT_MISMATCH, -4.0, True),
    ("LEASE_EXPIRED", reputation.LEASE_EXPIRED, -0.25, False),
    ("STRUCTURE_INVALID", reputation.REJECTED, -1.0, False),
])
def test_rejection_decisions(code, kind, weight, proof):
    d = reputation.rejection_decision(code, "why", "bid", ReputationConfig())
    assert (d.evidence.kind, d.evidence.weight, d.keep_proof) == (kind, weight, proof)
    assert d.evidence.bundle_id == "bid" and d.evidence.detail.startswith(f"{code}: why")
    assert d.ban_reason == (f"proof: {code}" if proof else None)
    off = reputation.rejection_decision(code, "why", "bid",
                                        ReputationConfig(auto_ban_on_proof=False))
    assert off.ban_reason is None and off.keep_proof == proof


CFG = ReputationConfig(feedback_weight=0.5, feedback_cap=2.0, corroborating_reporters=2)
NOW = 1_000_000


def test_feedback_weights_are_scaled_by_the_reporter_and_capped_within_the_report():
    # reporter standing good=6, bad=0 at NOW: score (6+1)/(6+0+2) = 0.875 -> 0.4375 each
    reporter = Standing(6.0, 0.0, NOW)
    good = FeedbackEntry("s1", groups=2, mean_log_ratio=0.1)
    bad = FeedbackEntry("s2", mean_log_ratio=2.0)  # |0.1| ok; |2.0| > 1.5: negative
    views = [SenderView(False, used_positive=1.8), SenderView(False),
             SenderView(False, used_positive=1.8)]
    out = reputation.feedback_evidence("r", reporter, [good, bad, good], views, NOW, CFG)
    # the third entry comes out weightless (the first used the room): no evidence row
    assert [n for n, _ in out] == ["s1", "s2"]
    assert out[0][1].weight == pytest.approx(0.2)      # room 2.0 - 1.8
    assert out[1][1].weight == pytest.approx(-0.4375)
    assert all(e.reporter_node_id == "r" for _, e in out)


def test_corroborated_negative_feedback_has_the_larger_but_finite_cap():
    reporter = Standing(0.0, 0.0, NOW)  # score 0.5 -> weight 0.25
    entry = FeedbackEntry("s", filtered_frac=0.9)
    alone = reputation.feedback_evidence("r", reporter, [entry],
                                         [SenderView(False, used_negative=2.0)], NOW, CFG)
    q = frozenset({"q"})
    agreed = reputation.feedback_evidence(
        "r", reporter, [entry], [SenderView(False, used_negative=2.0, negative_reporters=q)],
        NOW, CFG)
    near_cap = reputation.feedback_evidence(
        "r", reporter, [entry], [SenderView(False, used_negative=9.9, negative_reporters=q)],
        NOW, CFG)
    at_cap = reputation.feedback_evidence(
        "r", reporter, [entry], [SenderView(False, used_negative=10.0, negative_reporters=q)],
        NOW, CFG)
    assert alone == []  # capped at 2.0: weightless, no row
    assert agreed[0][1].weight == pytest.approx(-0.25)
    assert near_cap[0][1].weight == pytest.approx(-0.1)  # corroborated_cap 10 - 9.9
    assert at_cap == []


def test_reporter_factor_is_zero_on_probation_or_quarantine_then_grows_with_age():
    cfg = ReputationConfig(probation_bundles=5, reporter_maturity_s=1800.0)
    fresh = Standing(0.0, 0.0, NOW)
    registered = NOW - 900_000  # 900 s old
    assert reputation.reporter_factor(fresh, 4, registered, NOW, cfg) == 0.0  # probation
    assert reputation.reporter_factor(fresh, 5, registered, NOW, cfg) == pytest.approx(0.5)
    assert reputation.reporter_factor(fresh, 5, NOW - 3_600_000, NOW, cfg) == 1.0
    assert reputation.reporter_factor(fresh, 5, NOW, NOW, cfg) == 0.0  # age 0
    jailed = Standing(0.0, 9.0, NOW, quarantined=True)
    assert reputation.reporter_factor(jailed, 50, NOW - 3_600_000, NOW, cfg) == 0.0
    instant = ReputationConfig(reporter_maturity_s=0.0)
    assert reputation.reporter_factor(fresh, 5, NOW, NOW, instant) == 1.0


def test_factor_scales_the_weight_and_zero_factor_writes_nothing():
    reporter = Standing(6.0, 0.0, NOW)  # score 0.875 -> 0.4375
    entry = FeedbackEntry("s", mean_log_ratio=3.0)
    half = reputation.feedback_evidence("r", reporter, [entry], [SenderView(False)], NOW, CFG,
                                        factor=0.5)
    assert half[0][1].weight == pytest.approx(-0.21875)
    assert reputation.feedback_evidence("r", reporter, [entry], [SenderView(False)], NOW, CFG,
                                        factor=0.0) == []


def test_entries_without_counted_bundles_or_praising_a_quarantined_sender_carry_no_weight():
    reporter = Standing(6.0, 0.0, NOW)
    praise = FeedbackEntry("s", mean_log_ratio=0.1)
    blame = FeedbackEntry("s", mean_log_ratio=3.0)
    none_counted = SenderView(False, counted_bundles=0)
    jailed = SenderView(False, sender_quarantined=True)
    assert reputation.feedback_evidence("r", reporter, [praise, blame],
                                        [none_counted, none_counted], NOW, CFG) == []
    out = reputation.feedback_evidence("r", reporter, [praise, blame], [jailed, jailed],
                                       NOW, CFG)
    assert [(n, e.weight) for n, e in out] == [("s", pytest.approx(-0.4375))]


def test_false_text_report_charges_the_reporter_and_lowers_its_later_weights():
    reporter = Standing(6.0, 0.0, NOW)
    lie = FeedbackEntry("s", text_mismatches=3)
    later = FeedbackEntry("t")
    out = reputation.feedback_evidence("r", reporter, [lie, later],
                                       [SenderView(True), SenderView(False)], NOW, CFG)
    assert out[0] == ("r", out[0][1]) and out[0][1].kind == reputation.FALSE_REPORT
    assert out[0][1].weight == -3.0
    # score after: (6+1)/(6+3+2) = 7/11 -> 0.5 * 7/11
    assert out[1][1].weight == pytest.approx(0.5 * 7 / 11)


def test_disputed_needs_enough_reporters():
    assert not reputation.disputed(1, CFG)
    assert reputation.disputed(2, CFG)
    assert not reputation.disputed(5, ReputationConfig(corroborating_reporters=0))


def test_shaded_logprobs_report_is_negative_within_the_old_tolerance():
    """Issue 13, class 4: +ln 2 nats/token (every sampler log-prob lowered by ln C, C = 2)
    counted as praise under |mean| <= 1.5; with its completion count and standard error
    the same report is negative evidence (0.693 - 3 x 0.04 = 0.573 > 0.05)."""
    reporter = Standing(6.0, 0.0, NOW)  # score 0.875 -> weight 0.4375
    old = FeedbackEntry("s", groups=4, tokens=400, mean_log_ratio=0.693)
    new = FeedbackEntry("s", groups=4, tokens=400, mean_log_ratio=0.693,
                        log_ratio_completions=16, log_ratio_stderr=0.04)
    honest = FeedbackEntry("h", groups=4, tokens=400, mean_log_ratio=-0.02,
                           log_ratio_completions=16, log_ratio_stderr=0.04)
    out = reputation.feedback_evidence("r", reporter, [old], [SenderView(False)], NOW, CFG)
    assert out[0][1].weight == pytest.approx(0.4375)  # what the review saw
    out = reputation.feedback_evidence("r", reporter, [new, honest],
                                       [SenderView(False), SenderView(False)], NOW, CFG)
    assert [(n, e.weight) for n, e in out] == [("s", pytest.approx(-0.4375)),
                                               ("h", pytest.approx(0.4375))]
    assert "stderr 0.040, 16 completions" in out[0][1].detail
