"""The submit path: one read, pure verification, pure evidence, one write.

:func:`submit_bundle` reads top to bottom as the issue asks:

1. :func:`~ftis.coordinator.verify.open_bundle`: size, signature, payload (pure);
2. :meth:`State.submission_snapshot`: node, lease, already-stored and dispute flags,
   recent submissions (one read transaction);
3. :func:`~ftis.coordinator.verify.check_submission`: every other check (pure);
4. :mod:`ftis.coordinator.reputation`: the evidence, proof and ban decisions (pure);
5. :meth:`State.commit_submission`: the bundle or the rejection verdict together with
   its evidence, proof and ban (one write transaction), so nothing acknowledged exists
   without its evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import REFUSAL_HOLD_MS, Context
from ftis.coordinator.state.base import BundleRecord, NodeRecord, SubmissionSnapshot, Verdict
from ftis.coordinator.verify import (
    BundleQuota,
    OpenedBundle,
    VerifiedBundle,
    check_submission,
    open_bundle,
    quota_refusal,
)
from ftis.protocol.errors import ErrorCode, FtisError, code_name
from ftis.v1 import bundle_pb2

log = logging.getLogger(__name__)

#: The bundle quota's window (the config's limits are per minute).
QUOTA_WINDOW_MS = 60_000
#: Rejections that are never charged to the signer: it is unknown or already banned, or
#: the coordinator could not run a drawn spot check (its own capacity, not the sender's
#: fault).
_UNCHARGED = (ErrorCode.NODE_UNKNOWN, ErrorCode.NODE_BANNED, ErrorCode.VERIFICATION_BUSY)


def submit_bundle(ctx: Context, envelope: bundle_pb2.SignedEnvelope | bytes) -> BundleRecord:
    """Verify a signed bundle and durably store it with its +1 evidence (or -2 per
    reward mismatch; 0 while the sender is disputed), or store the rejection verdict with
    its evidence, proof and ban; returns only after the commit.

    Raises:
        FtisError: the first failing check's code (see :mod:`ftis.coordinator.verify`),
            or BUNDLE_REPLAYED if a concurrent submission answered the lease first.
    """
    now = ctx.clock()
    try:
        opened = open_bundle(envelope, max_bundle_bytes=ctx.config.max_bundle_bytes)
    except FtisError as err:  # not attributable to anyone: the verdict row only, budgeted
        if not ctx.quotas.admit_unattributed_verdict():
            raise
        _reject(ctx, Verdict(None, None, err.code, err.reason), now, err)
    quota = BundleQuota(ctx.config.bundles_per_minute, ctx.config.bundle_bytes_per_minute)
    if ctx.refusals.held(opened.sender_id, now):
        raise quota_refusal(quota)
    policy = ctx.policy
    snapshot = ctx.state.submission_snapshot(
        opened.sender_id, opened.bundle.task_id, opened.bundle_id,
        since_ms=now - int(policy.half_life_s * 1000),
        window_start_ms=now - QUOTA_WINDOW_MS)
    # the sender's own registered tokenizer, never another's (verify.py, "Invariant")
    fingerprint = snapshot.node.fingerprint if snapshot.node else None
    tokenizer = ctx.tokenizers.get(fingerprint) if fingerprint is not None else None
    try:
        verified = check_submission(
            opened, snapshot, now_ms=now,
            tokenizer=tokenizer, tokenizer_fingerprint=fingerprint,
            score=ctx.rescoring.rescore,
            spot_check=_spot_check(ctx, policy),
            require_tokenizer=ctx.config.require_tokenizer,
            quota=quota,
            tokenizer_id_bound=(ctx.tokenizers.id_bound(fingerprint)
                                if tokenizer is not None and fingerprint is not None else None))
    except FtisError as err:
        if snapshot.already_stored:  # hand back the acknowledgement a retry may have lost
            err = ReplayedBundle(err.code, err.reason, ctx.state.get_bundle(opened.bundle_id))
        _reject(ctx, rejection_verdict(opened, snapshot, err, policy), now, err)
    verdict = acceptance_verdict(verified, snapshot, policy)
    try:
        committed = ctx.state.commit_submission(
            verdict, now, reputation.standing_update(list(verdict.evidence), now, policy),
            expected=snapshot.node)
    except FtisError as err:  # lost a race for the lease: nothing was written
        _reject(ctx, rejection_verdict(opened, snapshot, err, policy), now, err)
    assert committed.bundle is not None
    node = committed.node
    if node is not None and reputation.audit_passed_by_spot_check(
            node.audit_status, verified.spot_checked, policy):
        # the coordinator's own audit, from the held weights: written after the bundle's
        # commit and once per node (lost in a crash between the two, the node's next
        # checked bundle passes it again; nothing acknowledged depends on it)
        ctx.state.set_audit_status(node.node_id, reputation.AUDIT_PASSED)
        node = replace(node, audit_status=reputation.AUDIT_PASSED)
    _refresh_cached(ctx, node, now)
    return committed.bundle


def _spot_check(ctx: Context, policy: reputation.ReputationConfig
                ) -> Callable[[NodeRecord, bundle_pb2.Bundle, str], object] | None:
    """Check 9 for ``check_submission``: the spot checker with the node's probation
    status (which sets the share of its bundles that are checked)."""
    checker = ctx.spot_checks
    if checker is None:
        return None
    return lambda node, bundle, bundle_id: checker.check(
        bundle, bundle_id,
        reputation.in_probation(node.bundles_accepted, node.audit_status, policy),
        node.bundles_accepted)


def _refresh_cached(ctx: Context, node: NodeRecord | None, now: int) -> None:
    """Cache the record a commit returned, so that the node's next authenticated call in
    this process sees its new standing and quarantine flag at once (not up to
    ``NODE_CACHE_S`` later) without another read; a banned node's entry is dropped."""
    if node is None:
        return
    if node.banned:
        ctx.nodes.drop(node.node_id)
    else:
        ctx.nodes.put(node.node_id, node, now)


class ReplayedBundle(FtisError):
    """BUNDLE_REPLAYED for a payload that is already stored, with its stored record:
    the reply carries the stored bundle's id and verified rewards, so a node whose first
    reply was lost (it retried after a timeout) gets its acknowledgement. The rewards are
    public anyway (they are relayed), so a third party replaying it learns nothing new,
    and it is still charged to no one and stores nothing."""

    def __init__(self, code: int, reason: str, stored: BundleRecord | None) -> None:
        super().__init__(code, reason)
        self.stored = stored


def acceptance_verdict(verified: VerifiedBundle, snapshot: SubmissionSnapshot,
                       policy: reputation.ReputationConfig) -> Verdict:
    """The verdict that stores ``verified`` with its evidence (pure)."""
    mismatches = verified.reward_mismatches
    event = reputation.bundle_evidence(
        mismatches, verified.bundle_id,
        disputed=reputation.disputed(len(snapshot.negative_reporters), policy))
    return Verdict(
        node_id=verified.node.node_id, bundle_id=verified.bundle_id, code=0,
        reason=f"accepted; {mismatches} reward mismatches" if mismatches else "accepted",
        bundle=verified.to_new_bundle(), evidence=(event,))


def rejection_verdict(opened: OpenedBundle, snapshot: SubmissionSnapshot, err: FtisError,
                      policy: reputation.ReputationConfig) -> Verdict:
    """The verdict of a rejection after the signature verified (pure): evidence, proof
    and ban for the signer, unless it is unknown or banned, or the payload was already
    stored (a byte-identical resubmission may come from anyone holding a relayed copy,
    so it is charged to no one)."""
    if snapshot.already_stored:
        return Verdict(None, opened.bundle_id, err.code, err.reason)
    if snapshot.node is None or err.code in _UNCHARGED:
        return Verdict(opened.sender_id, opened.bundle_id, err.code, err.reason)
    decision = reputation.rejection_decision(code_name(err.code), err.reason,
                                             opened.bundle_id, policy)
    return Verdict(
        node_id=opened.sender_id, bundle_id=opened.bundle_id, code=err.code, reason=err.reason,
        evidence=(decision.evidence,),
        proof_envelope=opened.envelope_bytes if decision.keep_proof else None,
        ban_reason=decision.ban_reason)


def _reject(ctx: Context, verdict: Verdict, now: int, err: FtisError) -> NoReturn:
    """Write a rejection's verdict (its evidence failing must never mask the rejection
    itself), then re-raise ``err``."""
    log.info("bundle rejected from %s: %s", verdict.node_id or "?", err)
    if err.code == ErrorCode.RATE_LIMITED and verdict.node_id:
        ctx.refusals.hold(verdict.node_id, now + REFUSAL_HOLD_MS)
    if verdict.ban_reason:
        log.warning("auto-banning node %s: %s", verdict.node_id, verdict.ban_reason)
        ctx.nodes.drop(verdict.node_id or "")
    try:
        committed = ctx.state.commit_submission(
            verdict, now, reputation.standing_update(list(verdict.evidence), now, ctx.policy))
        _refresh_cached(ctx, committed.node, now)
    except Exception:
        log.exception("recording the verdict for %s failed", verdict.node_id)
    raise err
