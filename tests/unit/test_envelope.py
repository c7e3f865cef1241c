"""Signed envelopes: round trip, tamper detection, domain separation, size limit, keys."""

from __future__ import annotations

import os
import stat

import pytest

from ftis.coordinator.state.base import LeaseRecord
from ftis.lab.harness.coordinator import FP_A, build_bundle, model_card, register_envelope
from ftis.protocol.envelope import open_envelope, parse_envelope_bytes, seal
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.tasks.source import TaskEntry
from ftis.v1 import bundle_pb2, swarm_pb2

LIMIT = 1 << 20


def _small_bundle(identity: NodeIdentity) -> bundle_pb2.Bundle:
    lease = LeaseRecord(
        lease_id="l" * 32,
        task_id="t" * 32,
        node_id=identity.node_id,
        dataset="chain_sum",
        spec_index=0,
        entry=TaskEntry("chain_sum", 0, "1 + 2 =", "3", {}),
        group_size=2,
        max_new_tokens=8,
        issued_at_ms=0,
        deadline_ms=1,
    )
    return build_bundle(lease, identity, n_tokens=3)


def _code(fn) -> int:
    with pytest.raises(FtisError) as info:
        fn()
    return info.value.code


def test_round_trip_returns_message_and_node_id() -> None:
    identity = NodeIdentity.generate()
    bundle = _small_bundle(identity)
    envelope = seal("bundle", bundle, identity)
    opened, node_id = open_envelope(envelope, "bundle", bundle_pb2.Bundle, LIMIT)
    assert opened == bundle
    assert node_id == identity.node_id
    again = parse_envelope_bytes(envelope.SerializeToString(), LIMIT)
    assert open_envelope(again, "bundle", bundle_pb2.Bundle, LIMIT)[0] == bundle


def test_every_single_payload_byte_flip_breaks_the_signature() -> None:
    identity = NodeIdentity.generate()
    envelope = seal("bundle", _small_bundle(identity), identity)
    payload = envelope.payload
    assert 50 < len(payload) < 2000
    for i in range(len(payload)):
        tampered = bundle_pb2.SignedEnvelope()
        tampered.CopyFrom(envelope)
        tampered.payload = payload[:i] + bytes([payload[i] ^ 0xFF]) + payload[i + 1 :]
        code = _code(lambda t=tampered: open_envelope(t, "bundle", bundle_pb2.Bundle, LIMIT))
        assert code == ErrorCode.SIGNATURE_INVALID, f"byte {i}"


def test_every_single_signature_byte_flip_is_rejected() -> None:
    identity = NodeIdentity.generate()
    envelope = seal("bundle", _small_bundle(identity), identity)
    for field in ("signature", "public_key"):
        original = getattr(envelope, field)
        for i in range(len(original)):
            tampered = bundle_pb2.SignedEnvelope()
            tampered.CopyFrom(envelope)
            setattr(tampered, field, original[:i] + bytes([original[i] ^ 0x01]) + original[i + 1 :])
            code = _code(lambda t=tampered: open_envelope(t, "bundle", bundle_pb2.Bundle, LIMIT))
            assert code == ErrorCode.SIGNATURE_INVALID, f"{field} byte {i}"


def test_register_signature_cannot_be_replayed_as_bundle() -> None:
    identity = NodeIdentity.generate()
    envelope = register_envelope(identity, model_card(FP_A), 123)
    # Relabelled: the signature covers the payload type, so it no longer verifies.
    relabelled = bundle_pb2.SignedEnvelope()
    relabelled.CopyFrom(envelope)
    relabelled.payload_type = "bundle"
    code = _code(lambda: open_envelope(relabelled, "bundle", bundle_pb2.Bundle, LIMIT))
    assert code == ErrorCode.SIGNATURE_INVALID
    # Unchanged: wrong payload type for a bundle submission.
    code = _code(lambda: open_envelope(envelope, "bundle", bundle_pb2.Bundle, LIMIT))
    assert code == ErrorCode.PAYLOAD_TYPE_INVALID
    # And it still opens as what it is.
    payload, _ = open_envelope(envelope, "register", swarm_pb2.RegisterPayload, LIMIT)
    assert payload.timestamp_ms == 123


def test_oversized_payload_and_envelope_are_rejected() -> None:
    identity = NodeIdentity.generate()
    envelope = seal("bundle", _small_bundle(identity), identity)
    limit = len(envelope.payload) - 1
    code = _code(lambda: open_envelope(envelope, "bundle", bundle_pb2.Bundle, limit))
    assert code == ErrorCode.ENVELOPE_TOO_LARGE
    data = envelope.SerializeToString()
    assert _code(lambda: parse_envelope_bytes(data, len(data) - 1)) == ErrorCode.ENVELOPE_TOO_LARGE


def test_malformed_envelope_bytes() -> None:
    assert _code(lambda: parse_envelope_bytes(b"\x0a\x05ab", LIMIT)) == ErrorCode.ENVELOPE_MALFORMED


def test_key_file_is_private_and_reused(tmp_path) -> None:
    path = tmp_path / "keys" / "node.pem"
    first = NodeIdentity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = NodeIdentity.load_or_create(path)
    assert first.node_id == second.node_id
    assert first.public_key == second.public_key
    assert len(first.node_id) == 32
    assert NodeIdentity.generate().node_id != first.node_id
