"""Verification of registrations and rollout bundles (DESIGN.md section 5).

Bundle checks run in exactly this order, cheapest first; the first failure raises an
:class:`~ftis.protocol.errors.FtisError` with its stable code:

1. size limit ......................... ENVELOPE_TOO_LARGE (ENVELOPE_MALFORMED for raw bytes
   that do not decode)
2. envelope type, key, signature, payload decoding (``open_envelope``)
   ...................................... PAYLOAD_TYPE_INVALID, ENVELOPE_MALFORMED,
   SIGNATURE_INVALID, PAYLOAD_MALFORMED
3. payload not already stored ........... BUNDLE_REPLAYED (charged to no one)
   sender registered / not banned ...... NODE_UNKNOWN / NODE_BANNED
   then the sender's quota (bundles and bytes in the last minute) .. RATE_LIMITED
   then the signed payload is exactly the canonical encoding of its known fields
   (``check_canonical``) .............. PAYLOAD_UNKNOWN_FIELDS, PAYLOAD_NOT_CANONICAL
4. ``bundle.node_id`` == key's node id . NODE_MISMATCH
5. model card fingerprint == registered  MODEL_CARD_MISMATCH; where the sender's
   tokenizer is known, the registered vocab_size fits it .... VOCAB_SIZE_MISMATCH
6. lease: task known, lease owned by sender, lease id matches, not expired, not yet
   answered ............................ TASK_UNKNOWN, LEASE_FOREIGN, LEASE_UNKNOWN,
   LEASE_EXPIRED, BUNDLE_REPLAYED
7. structure (``check_structure`` with the lease's G and max_new_tokens, the
   registered vocab size, and the prompt bounds derived from the leased messages,
   ``prompt_limits``) ................... 13x codes, LOGPROB_TOO_SMALL, PROMPT_TOO_LONG
7b. text, where the coordinator knows the sender's tokenizer: every prompt and
   completion id is one the tokenizer can decode ............ TOKEN_NOT_IN_TOKENIZER;
   every completion's ``text == decode(token_ids, skip_special_tokens=False)``
   ...................................... TEXT_MISMATCH; the decoded prompt is at most
   the leased messages' characters + ``PROMPT_TEMPLATE_SLACK`` .... PROMPT_TOO_LONG, and
   contains the leased question verbatim .......................... PROMPT_MISMATCH.
   Without an uploaded tokenizer: TOKENIZER_REQUIRED when ``require_tokenizer``, else
   the bundle is stored with ``text_verified = False``.
8. re-score every completion with the shared scorer; claimed rewards (optional: an
   honest node cannot compute them, the answers never leave the coordinator) that differ
   by more than :data:`REWARD_TOLERANCE` are *counted*, not rejected. The serving
   coordinator runs this step in a worker process within a time budget
   (``rescoring.RescoringPool``) ..................................... SCORING_TIMEOUT.
9. where the coordinator holds the weights of the sender's model card and the bundle is
   drawn (every bundle of a node on probation by default), the claimed log-probs are
   recomputed and compared (:mod:`ftis.coordinator.spot_check`, in worker processes)
   ...................................... LOGPROB_SPOT_CHECK_FAILED; a drawn check that
   cannot run now ...................... VERIFICATION_BUSY (never charged).

Text checks are done only with the sender's own tokenizer (issue 13, class 2). Invariant:
:func:`check_text` (whose TEXT_MISMATCH is a ban-grade proof, ``reputation.PROOF_CODES``)
runs only with a tokenizer whose fingerprint equals the one the signing node registered
in its model card, which the bundle's own card repeats (check 5), and which the
coordinator itself accepted from an upload whose recomputed fingerprint matched
(``tokenizer_store.check_upload``; :meth:`TokenizerCache.get
<ftis.coordinator.tokenizer_store.TokenizerCache.get>` re-checks stored files). The
bundles handler looks the tokenizer up by the registered fingerprint and passes both;
:func:`check_submission` refuses (``RuntimeError``: an INTERNAL reply, nothing recorded,
nobody charged) a tokenizer held under any other fingerprint. Since the fingerprint
covers the decoder, normalizer, pre-tokenizer, post-processor, model and added tokens
(:mod:`ftis.protocol.fingerprint`), the tokenizer used decodes exactly as the one the
node itself uploaded or could upload: a TEXT_MISMATCH means the node's own tokenizer does
not decode its ids to its text. No other path decodes a node's ids on the coordinator.

Everything here is pure: :func:`open_bundle` needs only the envelope, and
:func:`check_submission` one read snapshot of the state
(:class:`~ftis.coordinator.state.base.SubmissionSnapshot`); the bundles handler
(:mod:`ftis.coordinator.handlers.bundles`) reads the snapshot and writes the verdict.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from ftis.coordinator.state.base import (
    LeaseRecord,
    NewBundle,
    NodeRecord,
    SubmissionSnapshot,
)
from ftis.coordinator.tokenizer_store import check_vocab_size, decode, undecodable_id
from ftis.protocol.bundles import (
    BundleLimits,
    check_canonical,
    check_structure,
    completion_tokens,
    prompt_limits,
)
from ftis.protocol.capabilities import MAX_CAPABILITIES, MAX_CAPABILITY_CHARS
from ftis.protocol.envelope import open_envelope, parse_envelope_bytes
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks import TaskEntry, render_messages
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)

#: |claimed - verified| above this counts as a reward mismatch.
REWARD_TOLERANCE = 1e-6
#: Bytes an envelope may carry beyond its payload (type, key, signature, field tags).
ENVELOPE_OVERHEAD_BYTES = 1024
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")
MAX_DISPLAY_NAME_CHARS = 128
MAX_CLIENT_VERSION_CHARS = 128
#: Largest model-card ``vocab_size`` a registration may claim: 16x Gemma 3's 262,144,
#: the largest vocabulary among the supported families. Where the tokenizer is known,
#: the card is compared with it (``tokenizer_store.check_vocab_size``).
MAX_VOCAB_SIZE = 1 << 22


@dataclass(frozen=True)
class OpenedBundle:
    """An envelope whose signature verified and whose payload decoded (checks 1-2).

    Attributes:
        bundle: the decoded payload.
        sender_id: the node id of the signing key (only set once the signature verified,
            so garbage signed with someone else's key is never charged to that node).
        bundle_id: hex SHA-256 of the payload.
        envelope_bytes: the envelope re-serialized from its four defined fields
            (payload type, payload, key, signature): kept as proof, stored and relayed, so
            nothing the sender added around the signed payload travels on.
        payload: the signed payload bytes (checked for canonical encoding).
    """

    bundle: bundle_pb2.Bundle
    sender_id: str
    bundle_id: str
    envelope_bytes: bytes
    payload: bytes = b""


@dataclass(frozen=True)
class BundleQuota:
    """The sender's per-minute submission quota, checked against the database's count
    of its recent verdicts (:class:`~ftis.coordinator.state.base.SubmissionSnapshot`),
    so that it holds across worker processes."""

    bundles_per_minute: float
    bundle_bytes_per_minute: int

@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle that passed every check, ready to be stored.

    Attributes:
        verified_rewards: coordinator reward per completion, in [0, 1], length G.
        reward_mismatches: completions whose claimed reward differed by > 1e-6.
        spot_checked: check 9 ran on this bundle and passed (its log-probs were
            recomputed with the held weights of its card).
    """

    bundle: bundle_pb2.Bundle
    node: NodeRecord
    lease: LeaseRecord
    bundle_id: str
    envelope_bytes: bytes
    verified_rewards: list[float]
    reward_mismatches: int
    text_verified: bool = False
    spot_checked: bool = False

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


def check_node_record(node: NodeRecord | None, node_id: str) -> NodeRecord:
    """``node`` (the record read for ``node_id``) if it is registered and not banned.

    Raises:
        FtisError: NODE_UNKNOWN or NODE_BANNED.
    """
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


def check_token_ids(tokenizer: object, bundle: bundle_pb2.Bundle) -> None:
    """Every prompt and completion id must be one the sender's tokenizer can decode
    (``decode`` would silently skip the others, so the text check alone cannot see them).

    Raises:
        FtisError: TOKEN_NOT_IN_TOKENIZER.
    """
    ids = set(bundle.prompt_token_ids)
    for c in bundle.completions:
        ids.update(c.token_ids)
    bad = undecodable_id(tokenizer, ids)  # type: ignore[arg-type]
    if bad is not None:
        raise FtisError(
            ErrorCode.TOKEN_NOT_IN_TOKENIZER,
            f"token id {bad} is not in the sender's uploaded tokenizer",
        )


def check_text(tokenizer: object, bundle: bundle_pb2.Bundle, question: str,
               max_prompt_chars: int | None = None) -> None:
    """Completion text must be the decoding of its tokens, and the decoded prompt must be
    at most ``max_prompt_chars`` long and contain the leased question verbatim
    (decoding: ``tokenizers`` backend, ``skip_special_tokens=False``).

    Raises:
        FtisError: TEXT_MISMATCH (also when decoding fails), PROMPT_TOO_LONG or
            PROMPT_MISMATCH.
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
    if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        raise FtisError(
            ErrorCode.PROMPT_TOO_LONG,
            f"decoded prompt has {len(prompt)} characters, the leased messages and a chat "
            f"template allow {max_prompt_chars}",
        )
    if question not in prompt:
        raise FtisError(
            ErrorCode.PROMPT_MISMATCH, "decoded prompt does not contain the leased question"
        )


def rescore(lease: LeaseRecord, bundle: bundle_pb2.Bundle) -> tuple[list[float], int]:
    """Re-score every completion with the shared scorer (:func:`rescore_texts` on the
    lease's stored entry; ``rescoring.RescoringPool`` runs it in a worker process).

    Returns:
        ``(verified_rewards, reward_mismatches)``: one reward in [0, 1] per completion,
        and how many claimed rewards differ from it by more than 1e-6 (completions
        with no claim are not counted).
    """
    return rescore_texts(lease.entry, [c.text for c in bundle.completions], claims(bundle))


def claims(bundle: bundle_pb2.Bundle) -> list[float | None]:
    """Each completion's claimed reward, ``None`` where it makes no claim."""
    return [c.claimed_reward if c.HasField("claimed_reward") else None
            for c in bundle.completions]


def rescore_texts(entry: TaskEntry, texts: list[str],
                  claimed: list[float | None]) -> tuple[list[float], int]:
    """The scorer's reward of each text under ``entry`` and the number of ``claimed``
    rewards (``None``: no claim) that differ from it by more than
    :data:`REWARD_TOLERANCE` (NaN claims count).

    A text longer than :data:`ftis.tasks.scoring.MAX_SCORED_TEXT_CHARS` scores 0 without
    reaching the scorer (as it does in ``score_completion`` on the client), so the work
    per completion is bounded whatever the structure check let through; extraction is
    linear in the text (:mod:`ftis.tasks.scoring`): a few ms for the longest text.
    """
    from ftis.tasks.scoring import MAX_SCORED_TEXT_CHARS

    rewards = [0.0 if len(t) > MAX_SCORED_TEXT_CHARS else entry.score(t) for t in texts]
    mismatches = sum(
        1 for c, r in zip(claimed, rewards, strict=True)
        if c is not None and not abs(c - r) <= REWARD_TOLERANCE)
    return rewards, mismatches


def open_bundle(
    envelope: bundle_pb2.SignedEnvelope | bytes, *, max_bundle_bytes: int
) -> OpenedBundle:
    """Checks 1-2 of the module docstring: size, envelope type, key, signature, payload.

    Args:
        envelope: the ``SignedEnvelope`` (or its serialized bytes as received).
        max_bundle_bytes: payload limit; the whole envelope may be
            :data:`ENVELOPE_OVERHEAD_BYTES` larger.

    Raises:
        FtisError: ENVELOPE_TOO_LARGE, ENVELOPE_MALFORMED, PAYLOAD_TYPE_INVALID,
            SIGNATURE_INVALID or PAYLOAD_MALFORMED.
    """
    envelope_limit = max_bundle_bytes + ENVELOPE_OVERHEAD_BYTES
    if isinstance(envelope, bytes | bytearray | memoryview):
        message = parse_envelope_bytes(bytes(envelope), envelope_limit)
    else:
        if envelope.ByteSize() > envelope_limit:
            raise FtisError(
                ErrorCode.ENVELOPE_TOO_LARGE,
                f"envelope is {envelope.ByteSize()} bytes, limit {envelope_limit}",
            )
        message = envelope
    bundle, sender_id = open_envelope(message, "bundle", bundle_pb2.Bundle, max_bundle_bytes)
    canonical = bundle_pb2.SignedEnvelope(
        payload_type=message.payload_type, payload=message.payload,
        public_key=message.public_key, signature=message.signature,
    ).SerializeToString(deterministic=True)
    return OpenedBundle(bundle, sender_id, hashlib.sha256(message.payload).hexdigest(),
                        canonical, bytes(message.payload))


def check_quota(snapshot: SubmissionSnapshot, size_bytes: int, quota: BundleQuota) -> None:
    """The sender's bundles and bytes in the last minute, this one included, within quota.

    Raises:
        FtisError: RATE_LIMITED.
    """
    if (snapshot.recent_submissions + 1 > quota.bundles_per_minute
            or snapshot.recent_bytes + size_bytes > quota.bundle_bytes_per_minute):
        raise quota_refusal(quota)


def quota_refusal(quota: BundleQuota) -> FtisError:
    """The RATE_LIMITED refusal of a sender over its bundle quota."""
    return FtisError(ErrorCode.RATE_LIMITED,
                     f"more than {quota.bundles_per_minute:g} bundles or "
                     f"{quota.bundle_bytes_per_minute} bytes per minute; slow down")


def check_submission(
    opened: OpenedBundle,
    snapshot: SubmissionSnapshot,
    *,
    now_ms: int,
    tokenizer: object | None = None,
    require_tokenizer: bool = False,
    quota: BundleQuota | None = None,
    tokenizer_id_bound: int | None = None,
    tokenizer_fingerprint: str | None = None,
    score: Callable[[LeaseRecord, bundle_pb2.Bundle], tuple[list[float], int]] = rescore,
    spot_check: Callable[[NodeRecord, bundle_pb2.Bundle, str], object] | None = None,
) -> VerifiedBundle:
    """Checks 3-8 of the module docstring on an opened envelope, against one read
    ``snapshot`` of the state. Pure: reads and writes nothing else.

    Args:
        tokenizer: the sender's uploaded tokenizer (text checks), or ``None``.
        tokenizer_fingerprint: the fingerprint ``tokenizer`` was accepted under
            (``TokenizerCache.get``'s key); required with ``tokenizer`` and must be the
            sender's registered one (module docstring, "Invariant").
        require_tokenizer: TOKENIZER_REQUIRED when ``tokenizer`` is ``None``.
        quota: the per-minute submission quota (``None``: unlimited).
        tokenizer_id_bound: ``token_id_bound(tokenizer)`` if the caller has it
            remembered (``TokenizerCache.id_bound``); computed from ``tokenizer``
            otherwise.
        score: check 8, ``(lease, bundle) -> (verified_rewards, reward_mismatches)``:
            :func:`rescore` here, or ``RescoringPool.rescore`` (the same function in a
            worker process with a time budget, SCORING_TIMEOUT past it).
        spot_check: check 9, ``(node, bundle, bundle_id) -> anything``, raising
            LOGPROB_SPOT_CHECK_FAILED or VERIFICATION_BUSY (the bundles handler's
            closure over ``SpotChecker.check``); ``None``: no spot checks.

    Raises:
        FtisError: the first failing check's code (see module docstring); for an
            identical resubmission (the payload is already stored) BUNDLE_REPLAYED
            before anything else: relayed envelopes are public, so it is charged to no one.
        RuntimeError: ``tokenizer`` given without ``tokenizer_fingerprint`` or under a
            fingerprint other than the sender's registered one (a coordinator bug: it is
            never turned into a verdict against the sender).
    """
    bundle, sender_id = opened.bundle, opened.sender_id
    if snapshot.already_stored:
        raise FtisError(ErrorCode.BUNDLE_REPLAYED,
                        f"bundle {opened.bundle_id[:16]} is already stored (identical "
                        "resubmission)")
    node = check_node_record(snapshot.node, sender_id)
    if tokenizer is not None and tokenizer_fingerprint != node.fingerprint:
        raise RuntimeError(
            f"text check of node {node.node_id} asked with the tokenizer of fingerprint "
            f"{(tokenizer_fingerprint or '(none)')[:16]}, registered "
            f"{node.fingerprint[:16]}: refused")
    if quota is not None:
        check_quota(snapshot, len(opened.envelope_bytes), quota)
    check_canonical(bundle, opened.payload)
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
    if tokenizer is not None:  # a card registered before its tokenizer was uploaded
        check_vocab_size(node.vocab_size, tokenizer_id_bound if tokenizer_id_bound is not None
                         else tokenizer)  # type: ignore[arg-type]
    lease = check_lease(snapshot.lease, bundle, sender_id, now_ms)
    max_prompt_tokens, max_prompt_chars = prompt_limits(
        m["content"] for m in render_messages(lease.entry.question))
    check_structure(
        bundle,
        BundleLimits(
            group_size=lease.group_size,
            max_new_tokens=lease.max_new_tokens,
            vocab_size=node.vocab_size,
            max_prompt_tokens=max_prompt_tokens,
            max_prompt_chars=max_prompt_chars,
        ),
    )
    if tokenizer is not None:
        check_token_ids(tokenizer, bundle)
        check_text(tokenizer, bundle, lease.entry.question, max_prompt_chars)
    elif require_tokenizer:
        raise FtisError(
            ErrorCode.TOKENIZER_REQUIRED,
            "no tokenizer uploaded for this fingerprint; call UploadTokenizer",
        )
    rewards, mismatches = score(lease, bundle)
    spot = spot_check(node, bundle, opened.bundle_id) if spot_check is not None else None
    return VerifiedBundle(
        bundle=bundle,
        node=node,
        lease=lease,
        bundle_id=opened.bundle_id,
        envelope_bytes=opened.envelope_bytes,
        verified_rewards=rewards,
        reward_mismatches=mismatches,
        text_verified=tokenizer is not None,
        spot_checked=spot is not None,
    )


def verify_registration(
    envelope: bundle_pb2.SignedEnvelope,
    *,
    max_payload_bytes: int,
    clock_skew_ms: int,
    now_ms: int,
) -> tuple[swarm_pb2.RegisterPayload, str]:
    """Check a signed registration.

    Rules: envelope as for bundles (payload type "register"); the payload canonically
    encoded with no unknown fields (``check_canonical``); ``|now - timestamp_ms|``
    within ``clock_skew_ms``; model card with ``0 < vocab_size <= MAX_VOCAB_SIZE`` and a
    lowercase 64-hex ``tokenizer_fingerprint``; display name and client version at most
    128 characters; at most :data:`~ftis.protocol.capabilities.MAX_CAPABILITIES`
    capabilities of at most ``MAX_CAPABILITY_CHARS`` characters each (unknown ones are
    allowed: the handler keeps only the known ones).

    Returns:
        ``(payload, node_id)``.

    Raises:
        FtisError: envelope codes (1xx, PAYLOAD_UNKNOWN_FIELDS, PAYLOAD_NOT_CANONICAL) or
            REGISTRATION_INVALID.
    """
    payload, node_id = open_envelope(
        envelope, "register", swarm_pb2.RegisterPayload, max_payload_bytes
    )
    check_canonical(payload, envelope.payload)
    skew = now_ms - payload.timestamp_ms
    if abs(skew) > clock_skew_ms:
        raise FtisError(
            ErrorCode.REGISTRATION_INVALID,
            f"registration timestamp is {skew} ms off the coordinator clock "
            f"(allowed {clock_skew_ms} ms); fix the clock",
        )
    card = payload.model_card
    if not 0 < card.vocab_size <= MAX_VOCAB_SIZE:
        raise FtisError(ErrorCode.REGISTRATION_INVALID,
                        f"model card vocab_size must be in [1, {MAX_VOCAB_SIZE}]")
    if not _FINGERPRINT.match(card.tokenizer_fingerprint):
        raise FtisError(
            ErrorCode.REGISTRATION_INVALID,
            "model card tokenizer_fingerprint must be 64 lowercase hex characters",
        )
    if len(payload.display_name) > MAX_DISPLAY_NAME_CHARS:
        raise FtisError(ErrorCode.REGISTRATION_INVALID, "display_name longer than 128 characters")
    if len(payload.client_version) > MAX_CLIENT_VERSION_CHARS:
        raise FtisError(ErrorCode.REGISTRATION_INVALID, "client_version longer than 128 characters")
    if len(payload.capabilities) > MAX_CAPABILITIES:
        raise FtisError(ErrorCode.REGISTRATION_INVALID,
                        f"more than {MAX_CAPABILITIES} capabilities listed")
    if any(len(c) > MAX_CAPABILITY_CHARS for c in payload.capabilities):
        raise FtisError(ErrorCode.REGISTRATION_INVALID,
                        f"a capability longer than {MAX_CAPABILITY_CHARS} characters")
    return payload, node_id
