"""Verification of registrations and rollout bundles (DESIGN.md section 5).

Bundle checks run in exactly this order, cheapest first; the first failure raises an
:class:`~ftis.protocol.errors.FtisError` with its stable code:

1. size limit ......................... ENVELOPE_TOO_LARGE (ENVELOPE_MALFORMED for raw bytes
   that do not decode)
2. envelope type, key, signature, payload decoding (``open_envelope``)
   ...................................... PAYLOAD_TYPE_INVALID, ENVELOPE_MALFORMED,
   SIGNATURE_INVALID, PAYLOAD_MALFORMED
3. sender registered / not banned ...... NODE_UNKNOWN / NODE_BANNED
   then the sender's quotas (bundles and bytes per minute, ``admit``) .. RATE_LIMITED
4. ``bundle.node_id`` == key's node id . NODE_MISMATCH
5. model card fingerprint == registered  MODEL_CARD_MISMATCH
6. lease: task known, lease owned by sender, lease id matches, not expired, not yet
   answered ............................ TASK_UNKNOWN, LEASE_FOREIGN, LEASE_UNKNOWN,
   LEASE_EXPIRED, BUNDLE_REPLAYED
7. structure (``check_structure`` with the lease's G and max_new_tokens and the
   registered vocab size) .............. 13x codes
7b. text, where the coordinator knows the sender's tokenizer: every completion's
   ``text == decode(token_ids, skip_special_tokens=False)`` .... TEXT_MISMATCH; the
   decoded ``prompt_token_ids`` contain the leased question verbatim .. PROMPT_MISMATCH.
   Without an uploaded tokenizer: TOKENIZER_REQUIRED when ``require_tokenizer``, else
   the bundle is stored with ``text_verified = False``.
8. re-score every completion with the shared scorer; claimed rewards that differ by
   more than :data:`REWARD_TOLERANCE` are *counted*, not rejected.

These are plain functions over a :class:`State` so that tests call them without gRPC.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from ftis.coordinator.state.base import (
    BundleRecord,
    LeaseRecord,
    NewBundle,
    NodeRecord,
    State,
)
from ftis.coordinator.tokenizer_store import TokenizerCache, decode
from ftis.protocol.bundles import BundleLimits, check_structure, completion_tokens
from ftis.protocol.envelope import open_envelope, parse_envelope_bytes
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)

#: |claimed - verified| above this counts as a reward mismatch.
REWARD_TOLERANCE = 1e-6
#: Bytes an envelope may carry beyond its payload (type, key, signature, field tags).
ENVELOPE_OVERHEAD_BYTES = 1024
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")
MAX_DISPLAY_NAME_CHARS = 128
MAX_CLIENT_VERSION_CHARS = 128


@dataclass
class SubmissionAudit:
    """What is known about a submission so far; used for the verdict row of a rejection.

    ``node_id`` is only filled once the signature has verified, so garbage signed with
    someone else's public key cannot be charged to that node.
    """

    node_id: str | None = None
    bundle_id: str | None = None
    #: The envelope as received (set once the signature verified; kept as proof).
    envelope_bytes: bytes = b""
    #: The exact payload is already stored: a resubmission, which anyone holding a
    #: relayed copy can send, so it is not attributable to the signer.
    duplicate: bool = False


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle that passed every check, ready to be stored.

    Attributes:
        verified_rewards: coordinator reward per completion, in [0, 1], length G.
        reward_mismatches: completions whose claimed reward differed by > 1e-6.
    """

    bundle: bundle_pb2.Bundle
    node: NodeRecord
    lease: LeaseRecord
    bundle_id: str
    envelope_bytes: bytes
    verified_rewards: list[float]
    reward_mismatches: int
    text_verified: bool = False

    def to_new_bundle(self) -> NewBundle:
        """The row to store for this bundle."""
        rewards = self.verified_rewards
        return NewBundle(
            bundle_id=self.bundle_id,
            node_id=self.node.node_id,
            task_id=self.lease.task_id,
            lease_id=self.lease.lease_id,
            fingerprint=self.node.fingerprint,
            envelope=self.envelope_bytes,
            verified_rewards=list(rewards),
            mean_reward=sum(rewards) / len(rewards),
            zero_variance=(max(rewards) - min(rewards)) <= 1e-12,
            completions=len(rewards),
            completion_tokens=completion_tokens(self.bundle),
            size_bytes=len(self.envelope_bytes),
            reward_mismatches=self.reward_mismatches,
            policy_version=self.bundle.policy_version,
            text_verified=self.text_verified,
        )


def check_node(state: State, node_id: str) -> NodeRecord:
    """The registered, unbanned node ``node_id``.

    Raises:
        FtisError: NODE_UNKNOWN or NODE_BANNED.
    """
    node = state.get_node(node_id)
    if node is None:
        raise FtisError(ErrorCode.NODE_UNKNOWN, f"node {node_id[:64]!r} is not registered")
    if node.banned:
        raise FtisError(ErrorCode.NODE_BANNED, f"node {node_id} is banned: {node.ban_reason}")
    return node


def check_lease(
    lease: LeaseRecord | None, bundle: bundle_pb2.Bundle, node_id: str, now_ms: int
) -> LeaseRecord:
    """Lease rules, in order: known task, owned by sender, same lease id, not expired,
    not yet answered.

    Raises:
        FtisError: TASK_UNKNOWN, LEASE_FOREIGN, LEASE_UNKNOWN, LEASE_EXPIRED or
            BUNDLE_REPLAYED.
    """
    if lease is None:
        raise FtisError(ErrorCode.TASK_UNKNOWN, f"no lease for task {bundle.task_id[:64]!r}")
    if lease.node_id != node_id:
        raise FtisError(ErrorCode.LEASE_FOREIGN, f"task {lease.task_id} is leased to another node")
    if bundle.lease_id != lease.lease_id:
        raise FtisError(
            ErrorCode.LEASE_UNKNOWN,
            f"lease {bundle.lease_id[:64]!r} is not the lease of task {lease.task_id}",
        )
    if now_ms > lease.deadline_ms:
        raise FtisError(
            ErrorCode.LEASE_EXPIRED,
            f"lease {lease.lease_id} expired {now_ms - lease.deadline_ms} ms ago",
        )
    if lease.bundle_id is not None:
        raise FtisError(
            ErrorCode.BUNDLE_REPLAYED,
            f"lease {lease.lease_id} already answered by bundle {lease.bundle_id}",
        )
    return lease


def check_text(tokenizer: object, bundle: bundle_pb2.Bundle, question: str) -> None:
    """Completion text must be the decoding of its tokens, and the decoded prompt must
    contain the leased question verbatim (decoding: ``tokenizers`` backend,
    ``skip_special_tokens=False``).

    Raises:
        FtisError: TEXT_MISMATCH (also when decoding fails) or PROMPT_MISMATCH.
    """
    for i, c in enumerate(bundle.completions):
        try:
            decoded = decode(tokenizer, c.token_ids)  # type: ignore[arg-type]
        except Exception as exc:  # the Rust binding raises plain Exception subclasses
            raise FtisError(
                ErrorCode.TEXT_MISMATCH, f"completion {i}: tokens do not decode: {exc}"
            ) from None
        if decoded != c.text:
            raise FtisError(
                ErrorCode.TEXT_MISMATCH,
                f"completion {i}: text differs from the decoded tokens "
                f"({len(c.text)} vs {len(decoded)} characters)",
            )
    try:
        prompt = decode(tokenizer, bundle.prompt_token_ids)  # type: ignore[arg-type]
    except Exception as exc:
        raise FtisError(ErrorCode.PROMPT_MISMATCH, f"prompt tokens do not decode: {exc}") from None
    if question not in prompt:
        raise FtisError(
            ErrorCode.PROMPT_MISMATCH, "decoded prompt does not contain the leased question"
        )


def rescore(lease: LeaseRecord, bundle: bundle_pb2.Bundle) -> tuple[list[float], int]:
    """Re-score every completion with the shared scorer.

    Returns:
        ``(verified_rewards, reward_mismatches)``: one reward in [0, 1] per completion,
        and how many claimed rewards differ from it by more than 1e-6.
    """
    rewards = [lease.entry.score(c.text) for c in bundle.completions]
    mismatches = sum(
        1
        for c, r in zip(bundle.completions, rewards, strict=True)
        if not abs(c.claimed_reward - r) <= REWARD_TOLERANCE  # NaN claims count too
    )
    return rewards, mismatches


def verify_bundle(
    state: State,
    envelope: bundle_pb2.SignedEnvelope | bytes,
    *,
    max_bundle_bytes: int,
    now_ms: int,
    audit: SubmissionAudit | None = None,
    tokenizers: TokenizerCache | None = None,
    require_tokenizer: bool = False,
    admit: Callable[[str, int], None] | None = None,
) -> VerifiedBundle:
    """Run every check of the module docstring on a submitted envelope; writes nothing
    (``admit`` may consume quota).

    Args:
        envelope: the ``SignedEnvelope`` (or its serialized bytes as received).
        max_bundle_bytes: payload limit; the whole envelope may be
            :data:`ENVELOPE_OVERHEAD_BYTES` larger.
        now_ms: current unix time in milliseconds.
        audit: filled with the sender and bundle id as they become known.
        tokenizers: uploaded tokenizers (text checks); ``None`` skips them.
        require_tokenizer: TOKENIZER_REQUIRED when the sender's tokenizer is unknown.
        admit: ``admit(node_id, envelope_bytes)`` raises RATE_LIMITED over quota.

    Raises:
        FtisError: the first failing check's code (see module docstring).
    """
    audit = audit if audit is not None else SubmissionAudit()
    envelope_limit = max_bundle_bytes + ENVELOPE_OVERHEAD_BYTES
    if isinstance(envelope, bytes | bytearray | memoryview):
        raw = bytes(envelope)
        message = parse_envelope_bytes(raw, envelope_limit)
    else:
        if envelope.ByteSize() > envelope_limit:
            raise FtisError(
                ErrorCode.ENVELOPE_TOO_LARGE,
                f"envelope is {envelope.ByteSize()} bytes, limit {envelope_limit}",
            )
        message = envelope
        raw = envelope.SerializeToString()
    bundle, sender_id = open_envelope(message, "bundle", bundle_pb2.Bundle, max_bundle_bytes)
    audit.node_id = sender_id
    bundle_id = hashlib.sha256(message.payload).hexdigest()
    audit.bundle_id = bundle_id
    audit.envelope_bytes = raw
    if state.bundle_owners([bundle_id]):
        # Relayed envelopes are public: a byte-identical resubmission may come from anyone,
        # so it is refused before quotas and charged to no one (not to the signer).
        audit.node_id, audit.duplicate = None, True
        raise FtisError(ErrorCode.BUNDLE_REPLAYED,
                        f"bundle {bundle_id[:16]} is already stored (identical resubmission)")

    node = check_node(state, sender_id)
    if admit is not None:
        admit(sender_id, len(raw))
    if bundle.node_id != sender_id:
        raise FtisError(
            ErrorCode.NODE_MISMATCH,
            f"bundle names node {bundle.node_id[:64]!r} but is signed by {sender_id}",
        )
    if bundle.model_card.tokenizer_fingerprint != node.fingerprint:
        raise FtisError(
            ErrorCode.MODEL_CARD_MISMATCH,
            "tokenizer fingerprint differs from the registered model card; re-register",
        )
    lease = check_lease(state.get_lease_by_task(bundle.task_id), bundle, sender_id, now_ms)
    check_structure(
        bundle,
        BundleLimits(
            group_size=lease.group_size,
            max_new_tokens=lease.max_new_tokens,
            vocab_size=node.vocab_size,
        ),
    )
    tokenizer = tokenizers.get(node.fingerprint) if tokenizers is not None else None
    if tokenizer is not None:
        check_text(tokenizer, bundle, lease.entry.question)
    elif require_tokenizer:
        raise FtisError(
            ErrorCode.TOKENIZER_REQUIRED,
            "no tokenizer uploaded for this fingerprint; call UploadTokenizer",
        )
    rewards, mismatches = rescore(lease, bundle)
    return VerifiedBundle(
        bundle=bundle,
        node=node,
        lease=lease,
        bundle_id=bundle_id,
        envelope_bytes=raw,
        verified_rewards=rewards,
        reward_mismatches=mismatches,
        text_verified=tokenizer is not None,
    )


def accept_bundle(
    state: State,
    envelope: bundle_pb2.SignedEnvelope | bytes,
    *,
    max_bundle_bytes: int,
    now_ms: int,
    audit: SubmissionAudit | None = None,
    tokenizers: TokenizerCache | None = None,
    require_tokenizer: bool = False,
    admit: Callable[[str, int], None] | None = None,
) -> BundleRecord:
    """Verify, then durably store a bundle; returns only after the commit.

    A rejection writes one verdict row (and nothing else) before re-raising; the
    coordinator adds reputation evidence on top (:meth:`Coordinator.submit_bundle`).

    Raises:
        FtisError: as :func:`verify_bundle`, or BUNDLE_REPLAYED if a concurrent
            submission answered the lease first.
    """
    audit = audit if audit is not None else SubmissionAudit()
    try:
        verified = verify_bundle(
            state,
            envelope,
            max_bundle_bytes=max_bundle_bytes,
            now_ms=now_ms,
            audit=audit,
            tokenizers=tokenizers,
            require_tokenizer=require_tokenizer,
            admit=admit,
        )
        return state.store_bundle(verified.to_new_bundle(), now_ms)
    except FtisError as err:
        log.info("bundle rejected from %s: %s", audit.node_id or "?", err)
        state.record_rejection(audit.node_id, audit.bundle_id, err.code, err.reason, now_ms)
        raise


def verify_registration(
    envelope: bundle_pb2.SignedEnvelope,
    *,
    max_payload_bytes: int,
    clock_skew_ms: int,
    now_ms: int,
) -> tuple[swarm_pb2.RegisterPayload, str]:
    """Check a signed registration.

    Rules: envelope as for bundles (payload type "register"); ``|now - timestamp_ms|``
    within ``clock_skew_ms``; model card with ``vocab_size > 0`` and a lowercase 64-hex
    ``tokenizer_fingerprint``; display name and client version at most 128 characters.

    Returns:
        ``(payload, node_id)``.

    Raises:
        FtisError: envelope codes (1xx) or REGISTRATION_INVALID.
    """
    payload, node_id = open_envelope(
        envelope, "register", swarm_pb2.RegisterPayload, max_payload_bytes
    )
    skew = now_ms - payload.timestamp_ms
    if abs(skew) > clock_skew_ms:
        raise FtisError(
            ErrorCode.REGISTRATION_INVALID,
            f"registration timestamp is {skew} ms off the coordinator clock "
            f"(allowed {clock_skew_ms} ms); fix the clock",
        )
    card = payload.model_card
    if card.vocab_size <= 0:
        raise FtisError(ErrorCode.REGISTRATION_INVALID, "model card vocab_size must be > 0")
    if not _FINGERPRINT.match(card.tokenizer_fingerprint):
        raise FtisError(
            ErrorCode.REGISTRATION_INVALID,
            "model card tokenizer_fingerprint must be 64 lowercase hex characters",
        )
    if len(payload.display_name) > MAX_DISPLAY_NAME_CHARS:
        raise FtisError(ErrorCode.REGISTRATION_INVALID, "display_name longer than 128 characters")
    if len(payload.client_version) > MAX_CLIENT_VERSION_CHARS:
        raise FtisError(ErrorCode.REGISTRATION_INVALID, "client_version longer than 128 characters")
    return payload, node_id
