"""Metrics handler: a node's training metrics and its feedback about the senders whose
bundles it trained on (docs/reputation.md "Receiver feedback").

Each feedback entry is checked on its own: invalid entries are dropped with a reason
(returned to the reporter in ``ReportMetricsResponse.dropped_feedback``) and the valid
ones are applied, so one bad entry (for example a statistic a hostile bundle made
non-finite) cannot void the rest of a report. A report with any invalid entry still
costs the reporter one FEEDBACK_INVALID evidence (-1), as a wholly invalid one did.

Who may move a reputation (issue 13, class 3; docs/reputation.md "Who may report"): a
reporter's weight is :func:`reputation.reporter_factor` (0 on probation or quarantined,
then growing with age), an entry counts only for bundles relayed to the reporter and not
counted for it before (recorded in the same transaction as the evidence), weightless
entries write nothing, and ReportMetrics has a per-node quota.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.reputation import Evidence, FeedbackEntry, SenderView
from ftis.coordinator.state.base import NodeRecord
from ftis.protocol.capabilities import AUDIT_ONLY_RELAY
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import swarm_pb2

MAX_METRICS = 256
MAX_METRIC_NAME_CHARS = 128
#: SenderFeedback entries per ReportMetrics, and bundle ids per entry.
MAX_FEEDBACK = 64
MAX_FEEDBACK_BUNDLE_IDS = 64

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DroppedFeedback:
    """A feedback entry that was not applied: its position in the report, the sender it
    named (at most 64 characters) and why (one line)."""

    index: int
    sender_id: str
    reason: str


def feedback_entries(feedback: Sequence[swarm_pb2.SenderFeedback]) -> list[FeedbackEntry]:
    """Decode ``SenderFeedback`` messages (no checks)."""
    return [FeedbackEntry(
        sender_id=f.sender_node_id, bundle_ids=tuple(f.bundle_ids), groups=f.groups,
        tokens=f.tokens, mean_log_ratio=f.mean_log_ratio, filtered_frac=f.filtered_frac,
        truncated_frac=f.truncated_frac, text_mismatches=f.text_mismatches,
        invalid_bundles=f.invalid_bundles, log_ratio_completions=f.log_ratio_completions,
        log_ratio_stderr=f.log_ratio_stderr) for f in feedback]


def entry_problem(reporter_id: str, f: FeedbackEntry, known_senders: set[str],
                  owners: dict[str, tuple[str, bool, int]]) -> str | None:
    """Why one feedback entry is invalid, or ``None`` (pure): it must be about a known
    other sender and its own bundles, with finite statistics, fractions in [0, 1], a
    non-negative standard error and counts, and at most 64 bundle ids."""
    if f.sender_id == reporter_id:
        return "about the reporter itself"
    if not all(math.isfinite(x) for x in (f.mean_log_ratio, f.filtered_frac,
                                           f.truncated_frac, f.log_ratio_stderr)):
        return "holds non-finite values"
    if f.log_ratio_stderr < 0:
        return "negative standard error"
    if not (0 <= f.filtered_frac <= 1 and 0 <= f.truncated_frac <= 1):
        return "fractions must be in [0, 1]"
    if min(f.groups, f.tokens, f.text_mismatches, f.invalid_bundles,
           f.log_ratio_completions) < 0:
        return "negative counts"
    if len(f.bundle_ids) > MAX_FEEDBACK_BUNDLE_IDS:
        return f"names more than {MAX_FEEDBACK_BUNDLE_IDS} bundles"
    if f.sender_id not in known_senders:
        return f"names unknown sender {f.sender_id[:64]!r}"
    for bundle_id in f.bundle_ids:
        owner = owners.get(bundle_id)
        if owner is None:
            return f"names unknown bundle {bundle_id[:64]!r}"
        if owner[0] != f.sender_id:
            return f"bundle {bundle_id[:64]} is not the sender's"
    return None


def check_feedback(reporter_id: str, entries: list[FeedbackEntry], known_senders: set[str],
                   owners: dict[str, tuple[str, bool, int]]) -> list[DroppedFeedback]:
    """The entries to drop, each with its reason (pure; see :func:`entry_problem`).

    Args:
        known_senders: the registered node ids among the entries' senders.
        owners: ``{bundle_id: (sender, text_verified, relay sequence)}`` of the named
            bundles that exist.

    Raises:
        FtisError: FEEDBACK_INVALID when the report has more than 64 entries (a bound on
            the request, not a problem of one entry).
    """
    if len(entries) > MAX_FEEDBACK:
        raise FtisError(ErrorCode.FEEDBACK_INVALID, f"more than {MAX_FEEDBACK} feedback entries")
    dropped = []
    for i, f in enumerate(entries):
        problem = entry_problem(reporter_id, f, known_senders, owners)
        if problem is not None:
            dropped.append(DroppedFeedback(i, f.sender_id[:64], f"feedback {i} {problem}"))
    return dropped


def report_metrics(ctx: Context, node: NodeRecord, step: int, values: dict[str, float],
                   feedback: Sequence[swarm_pb2.SenderFeedback] = ()) -> list[DroppedFeedback]:
    """Store a metrics report (non-finite values are kept as "nan"/"inf" strings) and
    turn its valid receiver feedback entries into reputation evidence
    (:func:`reputation.feedback_evidence`).

    Returns:
        the dropped (invalid) feedback entries with their reasons; when there are any,
        the reporter gets one -1 FEEDBACK_INVALID evidence with the valid entries'.

    Raises:
        FtisError: RATE_LIMITED (``reports_per_minute``; nothing stored),
            REQUEST_INVALID (more than 256 values or a name longer than 128
            characters), FEEDBACK_INVALID (more than 64 feedback entries: nothing is
            stored then, and the reporter gets -1 evidence; or a concurrent report
            counted the same bundles).
    """
    if not ctx.quotas.admit_report(node.node_id):
        raise FtisError(ErrorCode.RATE_LIMITED,
                        f"more than {ctx.config.reports_per_minute:g} reports per minute; "
                        "slow down")
    if len(values) > MAX_METRICS:
        raise FtisError(ErrorCode.REQUEST_INVALID, f"more than {MAX_METRICS} metrics")
    if any(len(k) > MAX_METRIC_NAME_CHARS for k in values):
        raise FtisError(ErrorCode.REQUEST_INVALID, "metric name longer than 128 characters")
    now = ctx.clock()
    dropped: list[DroppedFeedback] = []
    if feedback:
        dropped = _apply_feedback(ctx, node, feedback_entries(feedback), now)
    ctx.state.record_metrics(node.node_id, int(step), {str(k): float(v) for k, v in
                                                       values.items()}, now)
    return dropped


def _invalid_evidence(reason: str) -> Evidence:
    return Evidence(reputation.FEEDBACK_INVALID, reputation.WEIGHT_FEEDBACK_INVALID,
                    reason[:2000])


def _apply_feedback(ctx: Context, reporter: NodeRecord, entries: list[FeedbackEntry],
                    now: int) -> list[DroppedFeedback]:
    policy = ctx.policy
    state = ctx.state
    senders = {f.sender_id for f in entries[:MAX_FEEDBACK + 1]}
    owners = state.bundle_owners([b for f in entries[:MAX_FEEDBACK + 1]
                                  for b in f.bundle_ids[:MAX_FEEDBACK_BUNDLE_IDS + 1]])
    records = {s: state.get_node(s) for s in senders if len(s) <= 128}
    known = {s for s, record in records.items() if record is not None}
    try:
        dropped = check_feedback(reporter.node_id, entries, known, owners)
    except FtisError as err:
        state.apply_evidence_many([(reporter.node_id, _invalid_evidence(err.reason))], now,
                                  lambda events: reputation.standing_update(events, now, policy))
        raise
    events: list[tuple[str, Evidence]] = []
    if dropped:
        log.info("dropped %d of %d feedback entries from %s: %s", len(dropped), len(entries),
                 reporter.node_id, "; ".join(d.reason for d in dropped[:4]))
        events.append((reporter.node_id, _invalid_evidence(
            f"{len(dropped)} of {len(entries)} entries dropped: "
            + "; ".join(d.reason for d in dropped))))
        skip = {d.index for d in dropped}
        entries = [f for i, f in enumerate(entries) if i not in skip]
    # the reporter afresh: authentication may hand on a record up to NODE_CACHE_S old
    reporter = state.get_node(reporter.node_id) or reporter
    factor = reputation.reporter_factor(reporter.standing, reporter.bundles_accepted,
                                        reporter.registered_at_ms, now, policy,
                                        audit=reporter.audit_status)
    counted = _counted_bundles(ctx, reporter, entries, owners) if factor > 0 else \
        [[] for _ in entries]
    window_start = now - int(policy.half_life_s * 1000)
    views = []
    for f, counted_ids in zip(entries, counted, strict=True):
        sender = records[f.sender_id]
        view = SenderView(text_verified=_text_was_verified(ctx, f, owners),
                          counted_bundles=len(counted_ids),
                          sender_quarantined=sender is not None and sender.quarantined)
        if factor > 0:  # a weightless reporter's caps are moot: skip their reads
            used_pos, used_neg = state.feedback_used(reporter.node_id, f.sender_id,
                                                     window_start)
            view = replace(view, used_positive=used_pos, used_negative=used_neg,
                           negative_reporters=frozenset(
                               state.negative_reporters(f.sender_id, window_start)))
        views.append(view)
    events += reputation.feedback_evidence(reporter.node_id, reporter.standing, entries, views,
                                           now, policy, factor=factor)
    counted_ids = [b for ids in counted for b in ids]
    if events or counted_ids:
        changed = state.apply_evidence_many(
            events, now, lambda evs: reputation.standing_update(evs, now, policy),
            counted=(reporter.node_id, counted_ids) if counted_ids else None)
        for node_id, record in changed.items():  # fresher than any cached copy
            ctx.nodes.put(node_id, record, now)
    # only a client with the capability is relayed audit-only bundles (handlers/relay.py):
    # another one's entries about a sender on probation are no audit
    if policy.audit_reporters > 0 and factor > 0 and AUDIT_ONLY_RELAY in reporter.capabilities:
        _record_audits(ctx, reporter, entries, counted, records, now)
    return dropped


def audit_verdicts(entries: list[FeedbackEntry], counted: list[list[str]],
                   senders: dict[str, NodeRecord | None], reporter_fingerprint: str,
                   cfg: reputation.ReputationConfig) -> dict[str, bool]:
    """An established reporter's audit verdicts (pure; docs/reputation.md "Audit-based
    probation"): ``{sender: plausible}`` for each entry about a sender on probation
    (:func:`reputation.in_probation`) with the reporter's own tokenizer fingerprint (the
    only receivers audit-only bundles are relayed to; a counted bundle id alone only
    proves a relay sequence was served) that names at least one bundle relayed to this
    reporter and not counted before (``counted``) and judges something
    (:func:`reputation.audit_judgement`). A later entry about the same sender wins."""
    out: dict[str, bool] = {}
    for f, ids in zip(entries, counted, strict=True):
        sender = senders.get(f.sender_id)
        if sender is None or not ids or sender.fingerprint != reporter_fingerprint:
            continue
        if not reputation.in_probation(sender.bundles_accepted, sender.audit_status, cfg):
            continue
        verdict = reputation.audit_judgement(f, cfg)
        if verdict is not None:
            out[f.sender_id] = verdict
    return out


def _record_audits(ctx: Context, reporter: NodeRecord, entries: list[FeedbackEntry],
                   counted: list[list[str]], senders: dict[str, NodeRecord | None],
                   now: int) -> None:
    """Store the report's audit verdicts and re-decide the senders' audits; a sender whose
    audit turns to failed gets :func:`reputation.audit_failed_evidence` once."""
    policy = ctx.policy
    verdicts = audit_verdicts(entries, counted, senders, reporter.fingerprint, policy)
    if not verdicts:
        return
    changes = ctx.state.record_audits(
        reporter.node_id, verdicts, now,
        lambda good, bad: reputation.audit_status(good, bad, policy))
    failed = [(sender, reputation.audit_failed_evidence(sender, bad))
              for sender, (old, new, bad) in changes.items()
              if new == reputation.AUDIT_FAILED_STATUS and old != new]
    if failed:
        log.info("audit failed for %s", ", ".join(s for s, _ in failed))
        ctx.state.apply_evidence_many(
            failed, now, lambda evs: reputation.standing_update(evs, now, policy))
    for sender, (old, new, _) in changes.items():
        if old != new:  # the next authenticated call sees the new audit at once
            ctx.nodes.drop(sender)


def _counted_bundles(ctx: Context, reporter: NodeRecord, entries: list[FeedbackEntry],
                     owners: dict[str, tuple[str, bool, int]]) -> list[list[str]]:
    """Per entry, its bundle ids that count (docs/reputation.md "Who may report"): relayed
    to this reporter (relay sequence at most the highest one served to it), not counted
    for it before, and not named by an earlier entry of the same report."""
    served = max(reporter.relay_served_seq, ctx.seen.served_through(reporter.node_id))
    taken = ctx.state.reported_bundles(reporter.node_id,
                                       [b for f in entries for b in f.bundle_ids])
    out = []
    for f in entries:
        ids = [b for b in dict.fromkeys(f.bundle_ids)
               if b not in taken and owners[b][2] <= served]
        taken.update(ids)
        out.append(ids)
    return out


def _text_was_verified(ctx: Context, f: FeedbackEntry,
                       owners: dict[str, tuple[str, bool, int]]) -> bool:
    """Whether the coordinator itself verified text == decode(tokens) on every bundle the
    entry is about (all the sender's stored bundles when none are named)."""
    if f.bundle_ids:
        return all(owners[b][1] for b in f.bundle_ids)
    total, unverified = ctx.state.count_text_unverified(f.sender_id)
    return total > 0 and unverified == 0
