"""Metrics handler: a node's training metrics and its feedback about the senders whose
bundles it trained on (docs/reputation.md "Receiver feedback")."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.reputation import Evidence, FeedbackEntry, SenderView
from ftis.coordinator.state.base import NodeRecord
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import swarm_pb2

MAX_METRICS = 256
MAX_METRIC_NAME_CHARS = 128
#: SenderFeedback entries per ReportMetrics, and bundle ids per entry.
MAX_FEEDBACK = 64
MAX_FEEDBACK_BUNDLE_IDS = 64


def feedback_entries(feedback: Sequence[swarm_pb2.SenderFeedback]) -> list[FeedbackEntry]:
    """Decode ``SenderFeedback`` messages (no checks)."""
    return [FeedbackEntry(
        sender_id=f.sender_node_id, bundle_ids=tuple(f.bundle_ids), groups=f.groups,
        tokens=f.tokens, mean_log_ratio=f.mean_log_ratio, filtered_frac=f.filtered_frac,
        truncated_frac=f.truncated_frac, text_mismatches=f.text_mismatches,
        invalid_bundles=f.invalid_bundles) for f in feedback]


def check_feedback(reporter_id: str, entries: list[FeedbackEntry], known_senders: set[str],
                   owners: dict[str, tuple[str, bool]]) -> None:
    """Feedback entries in bounds, about known other senders and their own bundles (pure).

    Args:
        known_senders: the registered node ids among the entries' senders.
        owners: ``{bundle_id: (sender, text_verified)}`` of the named bundles that exist.

    Raises:
        FtisError: FEEDBACK_INVALID with the first problem.
    """
    def invalid(reason: str) -> FtisError:
        return FtisError(ErrorCode.FEEDBACK_INVALID, reason)

    if len(entries) > MAX_FEEDBACK:
        raise invalid(f"more than {MAX_FEEDBACK} feedback entries")
    for i, f in enumerate(entries):
        if f.sender_id == reporter_id:
            raise invalid(f"feedback {i} is about the reporter itself")
        if not all(math.isfinite(x) for x in (f.mean_log_ratio, f.filtered_frac,
                                               f.truncated_frac)):
            raise invalid(f"feedback {i} holds non-finite values")
        if not (0 <= f.filtered_frac <= 1 and 0 <= f.truncated_frac <= 1):
            raise invalid(f"feedback {i}: fractions must be in [0, 1]")
        if min(f.groups, f.tokens, f.text_mismatches, f.invalid_bundles) < 0:
            raise invalid(f"feedback {i}: negative counts")
        if len(f.bundle_ids) > MAX_FEEDBACK_BUNDLE_IDS:
            raise invalid(f"feedback {i} names more than {MAX_FEEDBACK_BUNDLE_IDS} bundles")
        if f.sender_id not in known_senders:
            raise invalid(f"feedback {i} names unknown sender {f.sender_id[:64]!r}")
    for i, f in enumerate(entries):
        for bundle_id in f.bundle_ids:
            owner = owners.get(bundle_id)
            if owner is None:
                raise invalid(f"feedback {i} names unknown bundle {bundle_id[:64]!r}")
            if owner[0] != f.sender_id:
                raise invalid(f"feedback {i}: bundle {bundle_id} is not the sender's")


def report_metrics(ctx: Context, node: NodeRecord, step: int, values: dict[str, float],
                   feedback: Sequence[swarm_pb2.SenderFeedback] = ()) -> None:
    """Store a metrics report (non-finite values are kept as "nan"/"inf" strings) and
    turn its receiver feedback into reputation evidence
    (:func:`reputation.feedback_evidence`).

    Raises:
        FtisError: REQUEST_INVALID (more than 256 values or a name longer than 128
            characters), FEEDBACK_INVALID (nothing is stored then, and the reporter gets
            -1 evidence).
    """
    if len(values) > MAX_METRICS:
        raise FtisError(ErrorCode.REQUEST_INVALID, f"more than {MAX_METRICS} metrics")
    if any(len(k) > MAX_METRIC_NAME_CHARS for k in values):
        raise FtisError(ErrorCode.REQUEST_INVALID, "metric name longer than 128 characters")
    now = ctx.clock()
    if feedback:
        _apply_feedback(ctx, node, feedback_entries(feedback), now)
    ctx.state.record_metrics(node.node_id, int(step), {str(k): float(v) for k, v in
                                                       values.items()}, now)


def _apply_feedback(ctx: Context, reporter: NodeRecord, entries: list[FeedbackEntry],
                    now: int) -> None:
    policy = ctx.policy
    state = ctx.state
    senders = {f.sender_id for f in entries[:MAX_FEEDBACK + 1]}
    owners = state.bundle_owners([b for f in entries[:MAX_FEEDBACK + 1]
                                  for b in f.bundle_ids[:MAX_FEEDBACK_BUNDLE_IDS + 1]])
    known = {s for s in senders if len(s) <= 128 and state.get_node(s) is not None}
    try:
        check_feedback(reporter.node_id, entries, known, owners)
    except FtisError as err:
        event = Evidence(reputation.FEEDBACK_INVALID, reputation.WEIGHT_FEEDBACK_INVALID,
                         err.reason)
        state.apply_evidence_many([(reporter.node_id, event)], now,
                                  lambda events: reputation.standing_update(events, now, policy))
        raise
    window_start = now - int(policy.half_life_s * 1000)
    views = []
    for f in entries:
        used_pos, used_neg = state.feedback_used(reporter.node_id, f.sender_id, window_start)
        views.append(SenderView(
            text_verified=_text_was_verified(ctx, f, owners),
            used_positive=used_pos, used_negative=used_neg,
            negative_reporters=frozenset(state.negative_reporters(f.sender_id, window_start))))
    events = reputation.feedback_evidence(reporter.node_id, reporter.standing, entries, views,
                                          now, policy)
    if events:
        state.apply_evidence_many(events, now,
                                  lambda evs: reputation.standing_update(evs, now, policy))


def _text_was_verified(ctx: Context, f: FeedbackEntry,
                       owners: dict[str, tuple[str, bool]]) -> bool:
    """Whether the coordinator itself verified text == decode(tokens) on every bundle the
    entry is about (all the sender's stored bundles when none are named)."""
    if f.bundle_ids:
        return all(owners[b][1] for b in f.bundle_ids)
    total, unverified = ctx.state.count_text_unverified(f.sender_id)
    return total > 0 and unverified == 0
