"""Signed requests: the node's key authenticates every non-envelope call.

``digest = SHA-256(b"ftis/v1/request\\0" + method + b"\\0" + timestamp_ms (8 bytes,
big-endian, signed) + body)`` where ``body`` is the request serialized with
``deterministic=True`` and its ``auth`` field cleared; the node signs the digest with
Ed25519. Binding the method name and the body means a signature can be neither moved
to another call nor kept with altered fields; the timestamp bounds replays to the
coordinator's clock-skew window.
"""

from __future__ import annotations

import hashlib
import time

from google.protobuf.message import Message

from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity, verify_signature

DOMAIN = b"ftis/v1/request\0"
#: Default accepted difference between the request timestamp and the server clock.
DEFAULT_SKEW_MS = 300_000


def request_digest(method: str, timestamp_ms: int, request: Message) -> bytes:
    """32-byte digest that is signed for ``request`` (its ``auth`` field is ignored)."""
    body = _body(request)
    return hashlib.sha256(
        DOMAIN + method.encode() + b"\0" + timestamp_ms.to_bytes(8, "big", signed=True) + body
    ).digest()


def _body(request: Message) -> bytes:
    copy = type(request)()
    copy.CopyFrom(request)
    copy.ClearField("auth")
    return copy.SerializeToString(deterministic=True)


def sign_request(request: Message, method: str, identity: NodeIdentity,
                 now_ms: int | None = None) -> Message:
    """Fill ``request.auth`` (timestamp + signature) in place and return ``request``.

    Args:
        request: a message with an ``auth`` field of type ``ftis.v1.RequestAuth``.
        method: the RPC name, e.g. ``"LeaseTasks"``.
    """
    ts = int(time.time() * 1000) if now_ms is None else now_ms
    request.ClearField("auth")
    request.auth.timestamp_ms = ts
    request.auth.signature = identity.sign(request_digest(method, ts, request))
    return request


def verify_request(request: Message, method: str, public_key: bytes, now_ms: int,
                   skew_ms: int = DEFAULT_SKEW_MS) -> None:
    """Check ``request.auth`` against the node's registered public key.

    Raises:
        FtisError: AUTH_INVALID (missing or bad signature) or AUTH_EXPIRED (timestamp
            more than ``skew_ms`` away from ``now_ms``).
    """
    if not request.HasField("auth") or len(request.auth.signature) != 64:
        raise FtisError(ErrorCode.AUTH_INVALID, f"{method}: request is not signed")
    ts = request.auth.timestamp_ms
    if abs(ts - now_ms) > skew_ms:
        raise FtisError(ErrorCode.AUTH_EXPIRED,
                        f"{method}: timestamp {ts} is {abs(ts - now_ms)} ms from server time")
    if not verify_signature(public_key, request.auth.signature,
                            request_digest(method, ts, request)):
        raise FtisError(ErrorCode.AUTH_INVALID, f"{method}: signature does not verify")
