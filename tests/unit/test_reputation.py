"""Reputation: the Beta score with decay (pure functions), evidence from submissions,
quarantine with probation and hysteresis, receiver feedback (weighting, cap, invalid and
false reports), the admin surface and persistence of the policy."""

from __future__ import annotations

import logging
import math

import pytest

from ftis.coordinator import reputation as rep
from ftis.coordinator.reputation import Evidence, ReputationConfig, Standing
from ftis.coordinator.server.admin_service import AdminService
from ftis.lab.harness.coordinator import (
    FakeClock,
    build_bundle,
    load_tokenizer,
    make_coordinator,
    register,
    register_with_tokenizer,
    seal_bundle,
)
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import admin_pb2, swarm_pb2

HOUR_MS = 3600 * 1000

# -- pure functions ----------------------------------------------------------------------


def test_score_and_decay() -> None:
    assert rep.score(0, 0) == 0.5
    assert rep.score(8, 0) == 0.9
    assert rep.score(0, 2) == 0.25
    cfg = ReputationConfig(half_life_s=3600)
    standing = Standing(good=8, bad=4, updated_at_ms=0)
    assert rep.decayed(standing, HOUR_MS, 3600) == (4.0, 2.0)
    assert rep.decayed(standing, -5, 3600) == (8.0, 4.0)  # clock going back: no growth
    later = rep.apply(standing, [Evidence("x", 1.0), Evidence("y", -0.5)], 2 * HOUR_MS, 10, cfg)
    assert (later.good, later.bad, later.updated_at_ms) == (3.0, 1.5, 2 * HOUR_MS)
    assert rep.current_score(later, 2 * HOUR_MS, 3600) == pytest.approx(4 / 6.5)


def test_thresholds_probation_and_hysteresis() -> None:
    cfg = ReputationConfig()
    assert rep.threshold(4, cfg) == 0.45 and rep.on_probation(4, cfg)
    assert rep.threshold(5, cfg) == 0.3 and not rep.on_probation(5, cfg)
    assert rep.next_quarantined(False, 0.44, 0, cfg) is True
    assert rep.next_quarantined(False, 0.44, 5, cfg) is False
    assert rep.next_quarantined(True, 0.32, 5, cfg) is True  # not above 0.3 + 0.05 yet
    assert rep.next_quarantined(True, 0.36, 5, cfg) is False


def test_feedback_rules() -> None:
    cfg = ReputationConfig()

    def negative(**kw):
        values = dict(text_mismatches=0, invalid_bundles=0, mean_log_ratio=0.0, filtered_frac=0.0)
        values.update(kw)
        return rep.feedback_is_negative(cfg=cfg, **values)

    assert not negative()
    assert not negative(mean_log_ratio=-1.5, filtered_frac=0.5)
    assert negative(mean_log_ratio=1.51) and negative(mean_log_ratio=-1.6)
    assert negative(filtered_frac=0.51) and negative(text_mismatches=1)
    assert negative(invalid_bundles=1)
    assert rep.feedback_weight(True, 0.8, cfg) == -0.4
    assert rep.capped(-0.4, 1.8, cfg) == pytest.approx(-0.2)
    assert rep.capped(-0.4, 2.5, cfg) == 0.0
    assert rep.capped(0.3, 0.0, cfg) == 0.3


def test_shift_test_is_one_sided_beyond_margin_and_noise() -> None:
    """Issue 13, class 4: honest senders' expected mean log-ratio is -KL <= 0; a report is
    negative when mean - 3 x stderr > 0.05 nats/token with at least 8 completions."""
    cfg = ReputationConfig()
    assert (cfg.shift_margin, cfg.shift_z, cfg.shift_min_completions) == (0.05, 3.0, 8)
    # the review's shading: +ln 2 per token, stderr 0.02 -> 0.693 - 0.06 = 0.633 > 0.05
    assert rep.shift_detected(math.log(2), 0.02, 8, cfg)
    # too few completions to trust the standard error
    assert not rep.shift_detected(math.log(2), 0.02, 7, cfg)
    # clients that predate the statistic send 0 completions: never detected
    assert not rep.shift_detected(1.4, 0.0, 0, cfg)
    # 0.20 - 3 x 0.05 = 0.05: not above the margin; 0.2001: just above
    assert not rep.shift_detected(0.20, 0.05, 8, cfg)
    assert rep.shift_detected(0.2001, 0.05, 8, cfg)
    # one-sided: honest drift (mean -KL) and inflated log-probs are not a shift
    assert not rep.shift_detected(-0.9, 0.0, 100, cfg)
    # noisy: 0.30 - 3 x 0.10 = 0.0
    assert not rep.shift_detected(0.30, 0.10, 100, cfg)
    assert not rep.shift_detected(math.log(2), 0.0, 100,
                                  cfg.updated(shift_min_completions=0))  # 0 = off
    # in the feedback rule, within the old tolerance of 1.5
    values = dict(text_mismatches=0, invalid_bundles=0, mean_log_ratio=math.log(2),
                  filtered_frac=0.0, cfg=cfg)
    assert not rep.feedback_is_negative(**values)  # no shift statistics: as before
    assert rep.feedback_is_negative(**values, log_ratio_stderr=0.02, log_ratio_completions=8)


def test_config_validation() -> None:
    for bad in (
        {"quarantine_threshold": 1.5},
        {"half_life_s": 0},
        {"probation_bundles": -1},
        {"feedback_weight": math.nan},
        {"log_ratio_tolerance": 0},
        {"shift_margin": -0.1},
        {"shift_z": math.inf},
        {"shift_min_completions": -1},
    ):
        with pytest.raises(ValueError):
            ReputationConfig(**bad)
    assert ReputationConfig.from_dict({"half_life_s": 60, "unknown": 1}).half_life_s == 60


# -- evidence from submissions -------------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def coord(clock):
    return make_coordinator(clock, reputation={"half_life_s": 3600, "reporter_maturity_s": 0})


def _submit(coord, node, n: int = 1, **kwargs) -> list:
    records = []
    for lease in coord.lease_tasks(node.node_id, n, 2, 64):
        records.append(coord.submit_bundle(seal_bundle(build_bundle(lease, node, **kwargs), node)))
    return records


def _score(coord, node) -> float:
    return coord.reputation_of(coord.state.get_node(node.node_id))


def _relayed_senders(coord, reader) -> set[str]:
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    return {b.node_id for b in page}


def test_verified_bundles_build_reputation(coord) -> None:
    node = register(coord)
    _submit(coord, node, 3)
    assert _score(coord, node) == pytest.approx(4 / 5)
    kinds = [e.kind for e in coord.evidence(node.node_id)]
    assert kinds == ["bundle_verified"] * 3


def test_reputation_decays_toward_one_half(coord, clock) -> None:
    node = register(coord)
    _submit(coord, node, 4)
    clock.advance(3600)  # one half-life: good 4 -> 2
    assert _score(coord, node) == pytest.approx(3 / 4)


def test_reward_liar_is_quarantined_stored_but_not_relayed_then_recovers(coord) -> None:
    liar, reader = register(coord), register(coord)
    (record,) = _submit(coord, liar, claimed=[0.0, 1.0])  # both claims false
    assert record.reward_mismatches == 2 and record.verified_rewards == [1.0, 0.0]
    node = coord.state.get_node(liar.node_id)
    assert node.quarantined and node.bundles_accepted == 1  # stored and acknowledged
    assert _score(coord, liar) == pytest.approx(1 / 6)  # -2 per mismatch
    assert _relayed_senders(coord, reader) == set()
    assert coord.state.stats(coord.clock(), 1).quarantined_nodes == 1
    # honest bundles lift it again: probation threshold 0.45, leaves above 0.5
    _submit(coord, liar, 3)
    assert coord.state.get_node(liar.node_id).quarantined  # E = 4/9 = 0.44
    _submit(coord, liar, 3)
    assert _score(coord, liar) == pytest.approx(7 / 12)
    assert not coord.state.get_node(liar.node_id).quarantined
    assert _relayed_senders(coord, reader) == {liar.node_id}
    # bundles stored while quarantined stay unrelayed after the release: bundles 2-5 were
    # stored under quarantine (the 5th verified bundle ends probation: threshold 0.3, out
    # above 0.35 at E = 5/10); relayed are bundle 1 (stored before its evidence) and 6-7
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    assert [b.sequence for b in page if b.node_id == liar.node_id] == [1, 6, 7]


def test_relayed_bundles_carry_sender_reputation(coord) -> None:
    sender, reader = register(coord), register(coord)
    _submit(coord, sender, 2)
    page, _ = coord.pull_bundles(reader.node_id, 0, 64)
    assert [b.sender_reputation for b in page] == [pytest.approx(0.75)] * 2


def test_rejection_weights(coord, clock) -> None:
    node = register(coord)
    leases = coord.lease_tasks(node.node_id, 3, 2, 64)
    first = seal_bundle(build_bundle(leases[0], node), node)
    coord.submit_bundle(first)
    with pytest.raises(FtisError):
        coord.submit_bundle(first)  # identical resubmission: anyone can send it, not charged
    with pytest.raises(FtisError):  # a new signed bundle for an answered lease: -1
        coord.submit_bundle(seal_bundle(build_bundle(leases[0], node, seed=1), node))
    bad = build_bundle(leases[1], node)
    bad.completions[0].logprobs[0] = 1.0
    with pytest.raises(FtisError):
        coord.submit_bundle(seal_bundle(bad, node))  # LOGPROB_POSITIVE: -1
    clock.advance(601)
    with pytest.raises(FtisError):
        coord.submit_bundle(seal_bundle(build_bundle(leases[2], node), node))  # -0.25
    forged = seal_bundle(build_bundle(leases[2], node), NodeIdentity.generate())
    forged.public_key = node.public_key
    with pytest.raises(FtisError):
        coord.submit_bundle(forged)  # signature invalid: not charged to the node
    evidence = [(e.kind, e.weight) for e in coord.evidence(node.node_id)]
    assert evidence == [
        ("lease_expired", -0.25),
        ("rejected", -1.0),
        ("replayed", -1.0),
        ("bundle_verified", 1.0),
    ]


# -- receiver feedback ----------------------------------------------------------------------


def _feedback(sender, bundle_ids=(), **kwargs) -> swarm_pb2.SenderFeedback:
    return swarm_pb2.SenderFeedback(
        sender_node_id=sender.node_id, groups=1, tokens=10, bundle_ids=list(bundle_ids), **kwargs
    )


def _report(coord, reporter, *feedback) -> None:
    coord.report_metrics(reporter.node_id, 1, {"loss": 0.1}, list(feedback))


def _pull_all(coord, reader) -> None:
    """The reader is served every relayable bundle (feedback counts only for those)."""
    cursor = 0
    while True:
        page, cursor = coord.pull_bundles(reader.node_id, cursor, 64)
        if len(page) < 64:
            return


def _fresh(coord, sender, readers, n: int = 1) -> list[str]:
    """``n`` new verified bundles of ``sender``, relayed to every reader: their ids."""
    ids = [r.bundle_id for r in _submit(coord, sender, n)]
    for reader in readers:
        _pull_all(coord, reader)
    return ids


def _feedback_rows(coord, node) -> list:
    return [e for e in coord.evidence(node.node_id, 1000) if e.kind == "feedback"]


def test_feedback_is_weighted_by_the_reporter(coord) -> None:
    sender, reporter = register(coord), register(coord)
    _submit(coord, reporter, 5)  # past probation: score 6/7
    b1, b2 = _fresh(coord, sender, [reporter], 2)
    _report(coord, reporter, _feedback(sender, [b1], mean_log_ratio=0.1))
    (event, _, _) = coord.evidence(sender.node_id)
    assert event.kind == "feedback" and event.weight == pytest.approx(0.5 * 6 / 7)
    assert event.reporter_node_id == reporter.node_id and event.bundle_id == b1
    _report(coord, reporter, _feedback(sender, [b2], mean_log_ratio=2.0))
    assert coord.evidence(sender.node_id)[0].weight == pytest.approx(-0.5 * 6 / 7)
    # each bundle counts once per reporter; an entry naming no bundle counts nothing
    _report(coord, reporter, _feedback(sender, [b1, b2], mean_log_ratio=2.0))
    _report(coord, reporter, _feedback(sender, mean_log_ratio=2.0))
    assert len(_feedback_rows(coord, sender)) == 2


def test_fresh_identities_move_nobody_and_write_nothing(coord) -> None:
    """Issue 13, class 3: reporters on probation carry no weight (two fresh sybils drove
    an honest node from E = 0.875 to 0.121 before)."""
    honest = register(coord)
    sybils = [register(coord), register(coord)]
    _submit(coord, sybils[1], 4)  # one short of probation_bundles
    ids = _fresh(coord, honest, sybils, 6)
    before = coord.state.get_node(honest.node_id).standing
    for sybil in sybils:
        for _ in range(2):
            _report(coord, sybil, *[_feedback(honest, [b], invalid_bundles=1, filtered_frac=1.0)
                                    for b in ids])
    assert coord.state.get_node(honest.node_id).standing == before
    assert _feedback_rows(coord, honest) == []
    assert coord.state.reported_bundles(sybils[1].node_id, ids) == set()
    # a reporter that completes probation may report the same bundles once
    _submit(coord, sybils[1], 1)
    _report(coord, sybils[1], _feedback(honest, ids[:1], invalid_bundles=1))
    assert len(_feedback_rows(coord, honest)) == 1
    assert coord.state.reported_bundles(sybils[1].node_id, ids) == {ids[0]}


def test_only_bundles_relayed_to_the_reporter_count(coord) -> None:
    sender, reporter = register(coord), register(coord)
    _submit(coord, reporter, 5)
    (unseen,) = [r.bundle_id for r in _submit(coord, sender, 1)]
    _report(coord, reporter, _feedback(sender, [unseen], mean_log_ratio=3.0))
    assert _feedback_rows(coord, sender) == []
    _pull_all(coord, reporter)
    _report(coord, reporter, _feedback(sender, [unseen], mean_log_ratio=3.0))
    assert [e.weight for e in _feedback_rows(coord, sender)] == [pytest.approx(-0.5 * 6 / 7)]


def test_reporter_weight_grows_with_age(clock) -> None:
    coord = make_coordinator(clock, reputation={"half_life_s": 3600,
                                                "reporter_maturity_s": 1800})
    sender, reporter = register(coord), register(coord)
    _submit(coord, reporter, 5)
    b1, b2 = _fresh(coord, sender, [reporter], 2)
    _report(coord, reporter, _feedback(sender, [b1], mean_log_ratio=3.0))  # age 0: no weight
    assert _feedback_rows(coord, sender) == []
    clock.advance(900)
    _report(coord, reporter, _feedback(sender, [b2], mean_log_ratio=3.0))
    good = 5 * 0.5 ** (900 / 3600)  # the reporter's evidence decayed by a quarter half-life
    expected = -0.5 * (good + 1) / (good + 2) * (900 / 1800)
    assert [e.weight for e in _feedback_rows(coord, sender)] == [pytest.approx(expected)]


def test_report_metrics_has_a_quota(clock) -> None:
    coord = make_coordinator(clock, reports_per_minute=3)
    reporter = register(coord)
    for _ in range(3):
        _report(coord, reporter)
    with pytest.raises(FtisError) as info:
        _report(coord, reporter)
    assert info.value.code == ErrorCode.RATE_LIMITED
    clock.advance(20)  # one more report per 20 s
    _report(coord, reporter)


def test_one_false_reporter_cannot_sink_a_node_with_history(coord, clock) -> None:
    honest, liar, reader = register(coord), register(coord), register(coord)
    _submit(coord, honest, 5)  # past probation, E = 6/7
    _submit(coord, liar, 5)
    for _ in range(12):
        (b,) = _fresh(coord, honest, [liar])
        _report(coord, liar, _feedback(honest, [b], invalid_bundles=3, filtered_frac=1.0))
    node = coord.state.get_node(honest.node_id)
    assert node.rep_bad == pytest.approx(2.0)  # feedback_cap per half-life
    assert not node.quarantined and _score(coord, honest) > 0.6
    assert honest.node_id in _relayed_senders(coord, reader)
    rows = _feedback_rows(coord, honest)  # 0.5 x 6/7 each: the 5th is cut, then no rows
    assert len(rows) == 5 and "capped" in rows[0].detail
    clock.advance(3601)  # a new half-life window: the reporter may weigh in again
    (b,) = _fresh(coord, honest, [liar])
    _report(coord, liar, _feedback(honest, [b], invalid_bundles=1))
    assert coord.evidence(honest.node_id)[0].weight < 0


def test_corroborated_negative_feedback_has_a_larger_cap(coord) -> None:
    """A log-prob forger keeps earning +1 per verified bundle; one receiver's reports are
    capped at 2, but when two established receivers report it, its bundles earn nothing
    and their cap rises to ``corroborated_cap`` (10), enough to quarantine it."""
    forger, a, b = register(coord), register(coord), register(coord)
    for r in (a, b):
        _submit(coord, r, 5)  # reporters past probation, E = 6/7
    first = _fresh(coord, forger, [a, b], 6)  # E = 7/8 after 6 verified bundles
    for bundle_id in first[:5]:
        _report(coord, a, _feedback(forger, [bundle_id], mean_log_ratio=4.0))
    assert coord.state.get_node(forger.node_id).rep_bad == pytest.approx(2.0)  # capped
    assert not coord.state.get_node(forger.node_id).quarantined
    _report(coord, b, _feedback(forger, first[:1], mean_log_ratio=4.0))
    # while disputed, its verified bundles earn no credit (it cannot outpace the reports)
    good = coord.state.get_node(forger.node_id).rep_good
    for _ in range(22):
        fresh = _fresh(coord, forger, [a, b])
        _report(coord, b, _feedback(forger, fresh, mean_log_ratio=4.0))
        _report(coord, a, _feedback(forger, fresh, mean_log_ratio=4.0))
    node = coord.state.get_node(forger.node_id)
    assert node.rep_good == pytest.approx(good)
    assert node.quarantined
    # finite: each reporter at most corroborated_cap (10) per half-life
    assert 15 < node.rep_bad <= 20 + 1e-9
    assert any("corroborated" in e.detail for e in _feedback_rows(coord, forger))
    # the reporters themselves are untouched
    assert not coord.state.get_node(a.node_id).quarantined


def test_praise_cannot_lift_a_quarantine(coord) -> None:
    """Two established reporters praising a quarantined reward liar change nothing
    (before, two sybils lifted one back into relay)."""
    liar, a, b = register(coord), register(coord), register(coord)
    for r in (a, b):
        _submit(coord, r, 5)
    ids = _fresh(coord, liar, [a, b], 2)
    _submit(coord, liar, 2, claimed=[1.0, 1.0])  # wrong claims: quarantined
    node = coord.state.get_node(liar.node_id)
    assert node.quarantined
    for r in (a, b):
        _report(coord, r, *[_feedback(liar, [i], mean_log_ratio=0.0) for i in ids])
    assert coord.state.get_node(liar.node_id).standing == node.standing
    assert liar.node_id not in _relayed_senders(coord, a)


@pytest.mark.parametrize("case", ["unknown", "self", "no-bundle", "foreign", "nan", "inf",
                                  "negative", "fraction", "many-ids", "stderr-negative",
                                  "stderr-inf", "completions-negative"])
def test_invalid_feedback_entry_is_dropped_and_charged_the_rest_applied(coord, case) -> None:
    """One invalid entry (issue 13, class 5) no longer voids the report: it is dropped
    with its reason, the reporter is charged -1 once, and the valid entries and the
    metrics are applied."""
    sender, other, reporter = register(coord), register(coord), register(coord)
    _submit(coord, reporter, 5)  # an established reporter
    theirs, second = _submit(coord, other, 2)
    _pull_all(coord, reporter)
    bad = {
        "unknown": _feedback(NodeIdentity.generate()),
        "self": _feedback(reporter),
        "no-bundle": _feedback(sender, ["ab" * 32]),
        "foreign": _feedback(sender, [theirs.bundle_id]),
        "nan": _feedback(sender, mean_log_ratio=math.nan),
        "inf": _feedback(sender, mean_log_ratio=-math.inf),
        "negative": _feedback(sender, text_mismatches=-1),
        "fraction": _feedback(sender, filtered_frac=1.5),
        "many-ids": _feedback(sender, [theirs.bundle_id] * 65),
        "stderr-negative": _feedback(sender, log_ratio_stderr=-0.01),
        "stderr-inf": _feedback(sender, log_ratio_stderr=math.inf),
        "completions-negative": _feedback(sender, log_ratio_completions=-8),
    }[case]
    good = [_feedback(other, [r.bundle_id], mean_log_ratio=0.1) for r in (theirs, second)]
    dropped = coord.report_metrics(reporter.node_id, 1, {"loss": 0.1}, [good[0], bad, good[1]])
    assert [d.index for d in dropped] == [1] and dropped[0].reason.startswith("feedback 1 ")
    (event,) = [e for e in coord.evidence(reporter.node_id) if e.kind != "bundle_verified"]
    assert (event.kind, event.weight) == ("feedback_invalid", -1.0)
    assert "1 of 3 entries dropped" in event.detail
    assert coord.evidence(sender.node_id) == []
    applied = [e for e in coord.evidence(other.node_id) if e.kind == "feedback"]
    assert len(applied) == 2 and all(e.weight > 0 for e in applied)
    assert coord.state.get_node(reporter.node_id).latest_metrics == {"loss": 0.1}


def test_feedback_with_too_many_entries_is_refused_whole(coord) -> None:
    sender, reporter = register(coord), register(coord)
    with pytest.raises(FtisError) as info:
        _report(coord, reporter, *[_feedback(sender)] * 65)
    assert info.value.code == ErrorCode.FEEDBACK_INVALID
    (event,) = coord.evidence(reporter.node_id)
    assert (event.kind, event.weight) == ("feedback_invalid", -1.0)
    assert coord.evidence(sender.node_id) == []
    assert coord.state.get_node(reporter.node_id).latest_metrics == {}  # nothing stored


def test_false_text_mismatch_report_is_charged_and_ignored(clock) -> None:
    coord = make_coordinator(clock, require_tokenizer=True)
    sender, reporter = register_with_tokenizer(coord), register_with_tokenizer(coord)
    (lease,) = coord.lease_tasks(sender.node_id, 1, 2, 64)
    record = coord.submit_bundle(
        seal_bundle(build_bundle(lease, sender, tokenizer=load_tokenizer()), sender)
    )
    assert record.text_verified
    _report(coord, reporter, _feedback(sender, [record.bundle_id], text_mismatches=2))
    _report(coord, reporter, _feedback(sender, text_mismatches=1))  # all its bundles verified
    assert [e.kind for e in coord.evidence(reporter.node_id)] == ["false_report"] * 2
    assert coord.evidence(reporter.node_id)[0].weight == -3.0
    assert [e.kind for e in coord.evidence(sender.node_id)] == ["bundle_verified"]


def test_text_mismatch_report_counts_when_the_coordinator_could_not_check(coord) -> None:
    sender, reporter = register(coord), register(coord)  # no tokenizer: text unverified
    _submit(coord, reporter, 5)
    (record,) = _submit(coord, sender)
    _pull_all(coord, reporter)
    assert not record.text_verified
    _report(coord, reporter, _feedback(sender, [record.bundle_id], text_mismatches=1))
    assert coord.evidence(sender.node_id)[0].weight == pytest.approx(-0.5 * 6 / 7)
    assert {e.kind for e in coord.evidence(reporter.node_id)} == {"bundle_verified"}


# -- admin, unban, persistence ---------------------------------------------------------------


def test_admin_views_and_unban_clears_quarantine(coord) -> None:
    admin = AdminService(coord.ctx)
    node, reader = register(coord), register(coord)
    _submit(coord, node, claimed=[0.0, 1.0])
    shown = admin.GetNode(admin_pb2.GetNodeRequest(node_id=node.node_id[:10]), None)
    assert shown.error.code == 0
    info = shown.node
    assert info.quarantined and info.probation and info.reputation == pytest.approx(1 / 6)
    assert (info.evidence_good, info.evidence_bad) == (0.0, 4.0)
    assert [(e.kind, e.weight) for e in shown.evidence] == [("reward_mismatch", -4.0)]
    assert admin.Stats(admin_pb2.StatsRequest(), None).quarantined_nodes == 1
    listed = admin.ListNodes(admin_pb2.ListNodesRequest(), None).nodes
    assert {n.node_id: n.quarantined for n in listed} == {node.node_id: True, reader.node_id: False}
    unbanned = admin.UnbanNode(admin_pb2.UnbanNodeRequest(node_id=node.node_id), None).node
    assert not unbanned.quarantined and unbanned.evidence_bad == 0.0
    assert _relayed_senders(coord, reader) == {node.node_id}
    assert coord.evidence(node.node_id)[0].kind == "operator_reset"


def test_get_node_returns_newest_50_evidence_rows(coord) -> None:
    node = register(coord)
    _submit(coord, node, 55)
    shown = AdminService(coord.ctx).GetNode(admin_pb2.GetNodeRequest(node_id=node.node_id), None)
    assert len(shown.evidence) == 50 and not shown.node.probation


def test_audit_probation_without_a_bootstrap_is_refused_by_admin_and_at_start(
        tmp_path, clock) -> None:
    """Turning audit-based probation on with no seed, no held card and no passed audit
    would keep every node on probation for ever: the admin API refuses it and changes
    nothing; a coordinator configured so refuses to start; a seed makes both accept."""
    coord = make_coordinator(clock, db=f"sqlite:///{tmp_path / 'a.db'}")
    admin = AdminService(coord.ctx)
    on = admin_pb2.ReputationConfig()
    on.CopyFrom(admin.GetReputationConfig(admin_pb2.GetReputationConfigRequest(), None).config)
    on.audit_reporters = 2
    reply = admin.SetReputationConfig(admin_pb2.SetReputationConfigRequest(config=on), None)
    assert reply.error.code == ErrorCode.REQUEST_INVALID
    assert "no bootstrap" in reply.error.reason
    assert coord.reputation_config == ReputationConfig()  # unchanged
    assert coord.state.get_setting("reputation") is None
    coord.state.close()

    from ftis.coordinator.server.app import CoordinatorServer
    from ftis.lab.harness.coordinator import make_config

    db = f"sqlite:///{tmp_path / 'b.db'}"
    with pytest.raises(ValueError, match="no bootstrap"):
        CoordinatorServer(make_config(db=db, reputation=ReputationConfig(audit_reporters=2)))
    seeded = CoordinatorServer(make_config(db=db, reputation=ReputationConfig(audit_reporters=2),
                                           audit_seed_nodes=["ab" * 32]))
    seeded.state.close()


def test_set_reputation_config_validates_persists_and_reevaluates(tmp_path, clock) -> None:
    db = f"sqlite:///{tmp_path / 'c.db'}"
    coord = make_coordinator(clock, db=db)
    admin = AdminService(coord.ctx)
    node = register(coord)
    current = admin.GetReputationConfig(admin_pb2.GetReputationConfigRequest(), None).config
    assert current.quarantine_threshold == 0.3 and current.probation_bundles == 5
    bad = admin_pb2.ReputationConfig()
    bad.CopyFrom(current)
    bad.half_life_s = -1
    reply = admin.SetReputationConfig(admin_pb2.SetReputationConfigRequest(config=bad), None)
    assert reply.error.code == ErrorCode.REQUEST_INVALID
    bad.half_life_s, bad.quarantine_threshold = 60, 2.0
    reply = admin.SetReputationConfig(admin_pb2.SetReputationConfigRequest(config=bad), None)
    assert reply.error.code == ErrorCode.REQUEST_INVALID
    assert coord.reputation_config == ReputationConfig()
    stricter = admin_pb2.ReputationConfig()
    stricter.CopyFrom(current)
    stricter.probation_threshold = 0.6  # a fresh node (E = 0.5) is now below it
    stricter.auto_ban_on_proof = False
    reply = admin.SetReputationConfig(admin_pb2.SetReputationConfigRequest(config=stricter), None)
    assert reply.error.code == 0 and reply.config.probation_threshold == 0.6
    assert coord.state.get_node(node.node_id).quarantined
    coord.state.close()
    restarted = make_coordinator(clock, db=db)
    cfg = restarted.reputation_config
    assert cfg.probation_threshold == 0.6 and cfg.auto_ban_on_proof is False
    assert cfg.feedback_cap == 2.0  # settings outside the admin message are kept


@pytest.mark.parametrize(
    ("listen", "audit", "level", "says"),
    [
        ("0.0.0.0:0", 0, logging.WARNING, "correct answers are enough"),
        ("127.0.0.1:0", 0, logging.INFO, "correct answers are enough"),
        ("0.0.0.0:0", 2, logging.INFO, "an audit by 2 established receivers"),
    ],
)
def test_the_coordinator_says_at_start_how_probation_ends(
        tmp_path, caplog, listen: str, audit: int, level: int, says: str) -> None:
    """Count-based probation on a listener other machines can reach is a warning: a node
    with no model that computes correct answers earns standing there."""
    from ftis.coordinator.server.app import CoordinatorServer
    from ftis.lab.harness.coordinator import make_config

    seeds = ["ab" * 32] if audit else []
    server = CoordinatorServer(make_config(
        db=f"sqlite:///{tmp_path / 'c.db'}", listen=listen,
        reputation=ReputationConfig(audit_reporters=audit), audit_seed_nodes=seeds))
    with caplog.at_level(logging.INFO, logger="ftis.coordinator.server.app"):
        server.start()
        server.stop(None)
    said = [r for r in caplog.records if "probation" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == level and says in said[0].getMessage()
