"""Signed envelopes: exact payload bytes + Ed25519 signature over a domain-separated hash.

``digest = SHA-256(b"ftis/v1/" + payload_type + b"\\0" + payload)``; the signature is
Ed25519 over that digest. The domain prefix keeps a signature made for one payload type
(e.g. a registration) from being replayed as another (e.g. a bundle).
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity, node_id_from_public_key, verify_signature
from ftis.v1 import bundle_pb2

PAYLOAD_TYPES = ("bundle", "register")
DOMAIN_PREFIX = b"ftis/v1/"

M = TypeVar("M", bound=Message)


def signing_digest(payload_type: str, payload: bytes) -> bytes:
    """32-byte domain-separated SHA-256 digest that is signed.

    Raises:
        ValueError: if ``payload_type`` is not one of :data:`PAYLOAD_TYPES`.
    """
    if payload_type not in PAYLOAD_TYPES:
        raise ValueError(f"unknown payload type {payload_type!r}")
    return hashlib.sha256(DOMAIN_PREFIX + payload_type.encode() + b"\0" + payload).digest()


def seal(payload_type: str, message: Message, identity: NodeIdentity) -> bundle_pb2.SignedEnvelope:
    """Serialize ``message`` once and sign the exact bytes."""
    payload = message.SerializeToString(deterministic=True)
    return bundle_pb2.SignedEnvelope(
        payload_type=payload_type,
        payload=payload,
        public_key=identity.public_key,
        signature=identity.sign(signing_digest(payload_type, payload)),
    )


def open_envelope(
    envelope: bundle_pb2.SignedEnvelope,
    payload_type: str,
    message_cls: type[M],
    max_payload_bytes: int,
) -> tuple[M, str]:
    """Check size, type and signature of an envelope, then decode its payload.

    Checks run cheapest first (DESIGN.md section 5): size, type, key shape, signature,
    payload decoding.

    Returns:
        ``(message, node_id)`` where ``node_id`` is derived from the envelope's key.

    Raises:
        FtisError: ENVELOPE_TOO_LARGE, PAYLOAD_TYPE_INVALID, ENVELOPE_MALFORMED,
            SIGNATURE_INVALID or PAYLOAD_MALFORMED.
    """
    if len(envelope.payload) > max_payload_bytes:
        raise FtisError(
            ErrorCode.ENVELOPE_TOO_LARGE,
            f"payload is {len(envelope.payload)} bytes, limit {max_payload_bytes}",
        )
    if envelope.payload_type != payload_type:
        raise FtisError(
            ErrorCode.PAYLOAD_TYPE_INVALID,
            f"expected payload type {payload_type!r}, got {envelope.payload_type[:32]!r}",
        )
    if len(envelope.public_key) != 32 or len(envelope.signature) != 64:
        raise FtisError(
            ErrorCode.ENVELOPE_MALFORMED,
            "public key must be 32 bytes and signature 64 bytes",
        )
    digest = signing_digest(payload_type, envelope.payload)
    if not verify_signature(envelope.public_key, envelope.signature, digest):
        raise FtisError(ErrorCode.SIGNATURE_INVALID, "Ed25519 signature does not verify")
    message = message_cls()
    try:
        message.ParseFromString(envelope.payload)
    except DecodeError as exc:
        raise FtisError(ErrorCode.PAYLOAD_MALFORMED, f"payload does not decode: {exc}") from exc
    return message, node_id_from_public_key(envelope.public_key)


def parse_envelope_bytes(data: bytes, max_bytes: int) -> bundle_pb2.SignedEnvelope:
    """Decode a serialized :class:`SignedEnvelope` after a size check.

    Raises:
        FtisError: ENVELOPE_TOO_LARGE or ENVELOPE_MALFORMED.
    """
    if len(data) > max_bytes:
        raise FtisError(
            ErrorCode.ENVELOPE_TOO_LARGE, f"envelope is {len(data)} bytes, limit {max_bytes}"
        )
    envelope = bundle_pb2.SignedEnvelope()
    try:
        envelope.ParseFromString(data)
    except DecodeError as exc:
        raise FtisError(ErrorCode.ENVELOPE_MALFORMED, f"envelope does not decode: {exc}") from exc
    return envelope
