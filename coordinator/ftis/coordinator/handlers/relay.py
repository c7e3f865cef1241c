"""Relay handler: pages of other nodes' verified bundles."""

from __future__ import annotations

from dataclasses import dataclass

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.state.base import AuditRelay, BundleRecord, NodeRecord
from ftis.protocol.bundles import MAX_GRPC_MESSAGE_BYTES
from ftis.protocol.capabilities import AUDIT_ONLY_RELAY
from ftis.protocol.errors import ErrorCode, FtisError

#: Bundles per relay page are clamped to [1, MAX_PULL_BUNDLES].
MAX_PULL_BUNDLES = 64
#: Envelope bytes per relay page beyond the first bundle (keeps replies under the
#: receiver's gRPC message limit).
PULL_PAGE_BYTES = MAX_GRPC_MESSAGE_BYTES // 2
#: Reputation relayed for a sender without stored evidence (Beta(1, 1) mean).
NO_HISTORY_REPUTATION = 0.5


@dataclass(frozen=True)
class RelayPage:
    """One relay page: the records as stored (envelopes as signed, not re-parsed), each
    sender's reputation now (same order), and the cursor for the next page."""

    bundles: list[BundleRecord]
    sender_reputations: list[float]
    next_cursor: int


def pull_bundles(ctx: Context, node: NodeRecord, cursor: int, max_bundles: int,
                 tokenizer_fingerprint: str = "", skip_zero_variance: bool = False) -> RelayPage:
    """A relay page for ``node`` (never its own bundles, nor banned or quarantined
    senders'), see :meth:`State.pull_bundles`.

    A node assigned to a MERIT branch (``node.branch``) is relayed only bundles whose
    lease was issued under the same branch: branches train without communication. An
    unassigned node trains on the whole mix and is relayed every bundle, as before
    branches existed.

    Audit-based probation (``reputation.audit_reporters`` > 0; docs/reputation.md):
    bundles of senders on probation go only to *established* requesters
    (:func:`reputation.established`: past probation themselves, not quarantined) whose
    registered tokenizer fingerprint is the bundle's and whose client registered the
    ``audit-only-relay`` capability (an older client would train on them), marked
    ``audit_only``; other requesters never see them (their cursor moves past them).

    ``max_bundles`` is clamped to [1, 64]; a page also stops before exceeding
    :data:`PULL_PAGE_BYTES` of envelopes, or the node's relay bytes left this minute
    (``pull_bytes_per_minute``), whichever is less (it always holds at least one bundle).

    Raises:
        FtisError: RATE_LIMITED (another pull of this node is being served,
            ``pulls_per_minute``, or no relay bytes left).
    """
    if not ctx.quotas.start_pull(node.node_id):
        raise FtisError(ErrorCode.RATE_LIMITED,
                        "one relay page at a time: another pull of this node is being served")
    try:
        return _page(ctx, node, cursor, max_bundles, tokenizer_fingerprint, skip_zero_variance)
    finally:
        ctx.quotas.end_pull(node.node_id)


def _page(ctx: Context, node: NodeRecord, cursor: int, max_bundles: int,
          tokenizer_fingerprint: str, skip_zero_variance: bool) -> RelayPage:
    """:func:`pull_bundles` once the node holds its pull slot."""
    if not ctx.quotas.admit_pull(node.node_id):
        raise FtisError(ErrorCode.RATE_LIMITED,
                        f"more than {ctx.config.pulls_per_minute:g} pulls per minute; slow down")
    bytes_left = ctx.quotas.pull_bytes_left(node.node_id)
    if bytes_left < 1:
        raise FtisError(ErrorCode.RATE_LIMITED,
                        f"more than {ctx.config.pull_bytes_per_minute} bytes of relay pages "
                        f"per minute; slow down")
    policy = ctx.policy
    audit = None
    if policy.audit_reporters > 0:
        audit = AuditRelay(
            probation_bundles=policy.probation_bundles,
            established=(reputation.established(node.bundles_accepted, node.audit_status,
                                                node.quarantined, node.banned, policy)
                         and AUDIT_ONLY_RELAY in node.capabilities),
            fingerprint=node.fingerprint)
    bundles, next_cursor = ctx.state.pull_bundles(
        requester_id=node.node_id,
        cursor=max(int(cursor), 0),
        limit=min(max(int(max_bundles), 1), MAX_PULL_BUNDLES),
        max_bytes=min(PULL_PAGE_BYTES, bytes_left),
        fingerprint=tokenizer_fingerprint,
        skip_zero_variance=skip_zero_variance,
        branch=node.branch,
        audit=audit,
    )
    ctx.quotas.charge_pull_bytes(node.node_id, sum(b.size_bytes for b in bundles))
    now = ctx.clock()
    half_life = policy.half_life_s
    reputations = [
        NO_HISTORY_REPUTATION if b.sender_standing is None
        else reputation.current_score(b.sender_standing, now, half_life)
        for b in bundles
    ]
    ctx.seen.touch(node.node_id, now)
    if bundles:  # feedback counts only for bundles served to the reporter
        ctx.seen.served(node.node_id, max(b.sequence for b in bundles))
    return RelayPage(bundles, reputations, next_cursor)
