"""Node handlers: registration, request authentication, heartbeat, tokenizer upload.

Authentication of signed requests (``RequestAuth``, :mod:`ftis.protocol.auth`) runs
once per request, in the servicer's ``authenticated`` decorator, which hands the
:class:`NodeRecord` it read to the handler; its order is NODE_UNKNOWN → AUTH_INVALID /
AUTH_EXPIRED → NODE_BANNED.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from google.protobuf.message import Message

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.state.base import NodeRecord
from ftis.coordinator.tokenizer_store import check_upload, check_vocab_size
from ftis.coordinator.verify import check_node_record, verify_registration
from ftis.protocol.auth import verify_request
from ftis.protocol.capabilities import known_capabilities
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2

log = logging.getLogger(__name__)


def authenticate(ctx: Context, request: Message, method: str) -> NodeRecord:
    """The node that signed ``request`` (a request with ``node_id`` and ``auth``).

    Order: node known (NODE_UNKNOWN) → signature and timestamp over the request with the
    registered key (AUTH_INVALID / AUTH_EXPIRED, skew = ``register_clock_skew_s``) → not
    banned (NODE_BANNED). One database read, or none while the node's record is in
    ``ctx.nodes`` (:class:`~ftis.coordinator.handlers.context.NodeCache`, one second).
    """
    node_id = request.node_id  # type: ignore[attr-defined]
    now = ctx.clock()
    node = ctx.nodes.get(node_id, now)
    if node is None:
        node = ctx.state.get_node(node_id)
        if node is None:
            raise FtisError(ErrorCode.NODE_UNKNOWN, f"node {node_id[:64]!r} is not registered")
        ctx.nodes.put(node_id, node, now)
    verify_request(request, method, node.public_key, now,
                   int(ctx.config.register_clock_skew_s * 1000))
    return check_node_record(node, node_id)


def register(ctx: Context, envelope: bundle_pb2.SignedEnvelope, peer: str = "") -> NodeRecord:
    """Register a node, or update its model card and last-seen time.

    Args:
        peer: host of the caller (``quotas.peer_host(context.peer())``); new node ids
            are throttled globally and per host.

    Raises:
        FtisError: envelope codes, REGISTRATION_INVALID, NODE_BANNED,
            REGISTRATION_THROTTLED (new node ids only), VOCAB_SIZE_MISMATCH (a tokenizer
            with the card's fingerprint is known and the card's vocab_size does not fit
            it; nothing is stored), MODEL_NOT_CHECKABLE (``spot_checks.required`` and the
            card's weights are not held).
    """
    now = ctx.clock()
    payload, node_id = verify_registration(
        envelope,
        max_payload_bytes=ctx.config.max_bundle_bytes,
        clock_skew_ms=int(ctx.config.register_clock_skew_s * 1000),
        now_ms=now,
    )
    existing = ctx.state.get_node(node_id)
    if existing is not None and existing.banned:
        raise FtisError(ErrorCode.NODE_BANNED, f"node {node_id} is banned: {existing.ban_reason}")
    if existing is None and not ctx.quotas.admit_registration(peer):
        raise FtisError(ErrorCode.REGISTRATION_THROTTLED,
                        "too many new registrations right now; retry in a minute")
    card = payload.model_card
    if (ctx.spot_checks is not None and ctx.config.spot_checks.required
            and not ctx.spot_checks.holds(card)):
        raise FtisError(ErrorCode.MODEL_NOT_CHECKABLE,
                        f"this swarm requires spot-checkable models; {card.base_model!r} "
                        f"({card.quantization or 'no quantization'}) is not held")
    bound = ctx.tokenizers.id_bound(card.tokenizer_fingerprint)
    if bound is not None:  # the tokenizer is known: the card must fit it
        check_vocab_size(card.vocab_size, bound)
    node = ctx.state.upsert_node(
        node_id=node_id,
        public_key=bytes(envelope.public_key),
        display_name=payload.display_name,
        model_card=card.SerializeToString(deterministic=True),
        fingerprint=card.tokenizer_fingerprint,
        vocab_size=card.vocab_size,
        client_version=payload.client_version,
        now_ms=now,
        capabilities=known_capabilities(payload.capabilities),
    )
    if node_id in ctx.config.audit_seed_nodes and node.audit_status != reputation.AUDIT_PASSED:
        # an operator's seed of audit-based probation: no established receiver exists yet
        ctx.state.set_audit_status(node_id, reputation.AUDIT_PASSED)
        node = replace(node, audit_status=reputation.AUDIT_PASSED)
    ctx.nodes.drop(node_id)  # a new model card or key
    log.info("node %s registered (%s, %s)", node_id, payload.display_name, card.base_model)
    return node


def tokenizer_known(ctx: Context, fingerprint: str) -> bool:
    """Whether a tokenizer with this fingerprint was uploaded (and accepted: its
    fingerprint recomputed from the file matched, so it encodes and decodes exactly as the
    caller's own tokenizer of that fingerprint; see :mod:`ftis.coordinator.tokenizer_store`)."""
    return ctx.tokenizers.known(fingerprint)


def heartbeat(ctx: Context, node: NodeRecord, policy_version: int) -> tuple[int, float]:
    """Record that ``node`` is alive at ``policy_version`` (buffered, no write).

    Returns:
        ``(server time in unix ms, the node's reputation score now)``.

    Raises:
        FtisError: RATE_LIMITED (``heartbeats_per_minute``).
    """
    if not ctx.quotas.admit_heartbeat(node.node_id):
        raise FtisError(ErrorCode.RATE_LIMITED, f"more than "
                        f"{ctx.config.heartbeats_per_minute:g} heartbeats per minute; slow down")
    now = ctx.clock()
    ctx.seen.touch(node.node_id, now, policy_version)
    return now, reputation.current_score(node.standing, now, ctx.policy.half_life_s)


def upload_tokenizer(ctx: Context, node: NodeRecord, fingerprint: str,
                     tokenizer_json_gz: bytes) -> bool:
    """Store the node's gzip'd ``tokenizer.json`` (see :mod:`tokenizer_store`).

    Returns:
        True if newly stored, False if a tokenizer with this fingerprint already was
        (idempotent).

    Raises:
        FtisError: TOKENIZER_INVALID (too large, not gzip, inflates beyond
            ``max_tokenizer_json_bytes``, duplicate JSON keys, fingerprint recomputed from
            the file or from what loaded differs from the request's or the registered one,
            does not load), VOCAB_SIZE_MISMATCH (the registered model
            card's vocab_size does not fit the tokenizer, also when it is already
            stored), RATE_LIMITED.
    """
    cfg = ctx.config
    if len(tokenizer_json_gz) > cfg.max_tokenizer_gz_bytes:
        raise FtisError(ErrorCode.TOKENIZER_INVALID,
                        f"compressed tokenizer is {len(tokenizer_json_gz)} bytes, "
                        f"limit {cfg.max_tokenizer_gz_bytes}")
    if fingerprint != node.fingerprint:
        raise FtisError(ErrorCode.TOKENIZER_INVALID,
                        "fingerprint differs from the registered model card; re-register first")
    if ctx.state.has_tokenizer(fingerprint):
        _check_card_against_stored(ctx, node, fingerprint)
        return False
    if not ctx.quotas.admit_tokenizer_upload(node.node_id):
        raise FtisError(ErrorCode.RATE_LIMITED, "too many tokenizer uploads; retry later")
    with ctx.upload_lock:  # one decompression/parse at a time bounds memory
        if ctx.state.has_tokenizer(fingerprint):
            _check_card_against_stored(ctx, node, fingerprint)
            return False
        tokenizer, vocab_size = check_upload(
            tokenizer_json_gz, fingerprint, node.fingerprint,
            max_gz_bytes=cfg.max_tokenizer_gz_bytes, max_json_bytes=cfg.max_tokenizer_json_bytes,
            card_vocab_size=node.vocab_size)
        stored = ctx.state.store_tokenizer(fingerprint, tokenizer_json_gz, vocab_size,
                                           node.node_id, ctx.clock())
        ctx.tokenizers.put(fingerprint, tokenizer)
    log.info("tokenizer %s uploaded by %s (vocab %d)", fingerprint[:12], node.node_id, vocab_size)
    return stored


def _check_card_against_stored(ctx: Context, node: NodeRecord, fingerprint: str) -> None:
    """The node's registered vocab_size against the stored tokenizer (VOCAB_SIZE_MISMATCH)."""
    bound = ctx.tokenizers.id_bound(fingerprint)
    if bound is not None:
        check_vocab_size(node.vocab_size, bound)
