"""Bundle verification: one test per rejection code, state untouched on rejection, and
re-scoring with known rewards."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from ftis.lab.harness.coordinator import (
    FP_A,
    FP_B,
    VOCAB,
    FakeClock,
    build_bundle,
    make_coordinator,
    model_card,
    register,
    register_envelope,
    seal_bundle,
    signed,
    snapshot,
    verify_only,
)
from ftis.protocol.envelope import seal, signing_digest
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2


@pytest.fixture
def world():
    """A coordinator with one registered node holding one lease (G=4, 16 tokens)."""
    clock = FakeClock()
    coord = make_coordinator(clock, max_bundle_bytes=8192)
    node = register(coord)
    (lease,) = coord.lease_tasks(node.node_id, 1, 4, 16)
    return coord, node, lease


def _assert_rejected(coord, envelope, code: int) -> None:
    """Submission is rejected with ``code`` and nodes/leases/bundles are unchanged."""
    before = snapshot(coord)
    rejected_before = coord.state.rejections_by_code().get(code, 0)
    with pytest.raises(FtisError) as info:
        coord.submit_bundle(envelope)
    assert info.value.code == code, info.value
    assert "\n" not in info.value.reason and info.value.reason
    assert snapshot(coord) == before
    assert coord.state.rejections_by_code().get(code, 0) == rejected_before + 1


def _mutated(lease, node, mutate: Callable[[bundle_pb2.Bundle], None]):
    bundle = build_bundle(lease, node)
    mutate(bundle)
    return seal_bundle(bundle, node)


# -- envelope level ---------------------------------------------------------------


def test_malformed_envelope_bytes(world) -> None:
    coord, _, _ = world
    _assert_rejected(coord, b"\x0a\x05ab", ErrorCode.ENVELOPE_MALFORMED)


def test_oversized_envelope(world) -> None:
    coord, node, lease = world
    bundle = build_bundle(lease, node)
    bundle.prompt_text = "x" * 9000
    envelope = seal_bundle(bundle, node)
    _assert_rejected(coord, envelope, ErrorCode.ENVELOPE_TOO_LARGE)
    _assert_rejected(coord, envelope.SerializeToString(), ErrorCode.ENVELOPE_TOO_LARGE)


def test_wrong_signature(world) -> None:
    coord, node, lease = world
    envelope = seal_bundle(build_bundle(lease, node), NodeIdentity.generate())
    envelope.public_key = node.public_key  # claims to be `node`, signed by someone else
    _assert_rejected(coord, envelope, ErrorCode.SIGNATURE_INVALID)
    # Not charged to the node whose key was claimed.
    assert coord.state.rejections_by_code(node.node_id) == {}


def test_wrong_payload_type(world) -> None:
    coord, node, _ = world
    envelope = register_envelope(node, model_card(), coord.clock())
    _assert_rejected(coord, envelope, ErrorCode.PAYLOAD_TYPE_INVALID)


def test_payload_that_does_not_decode(world) -> None:
    coord, node, _ = world
    from ftis.protocol.envelope import signing_digest

    payload = b"\x0a\x05ab"
    envelope = bundle_pb2.SignedEnvelope(
        payload_type="bundle",
        payload=payload,
        public_key=node.public_key,
        signature=node.sign(signing_digest("bundle", payload)),
    )
    _assert_rejected(coord, envelope, ErrorCode.PAYLOAD_MALFORMED)


# -- sender ---------------------------------------------------------------------


def test_unknown_node(world) -> None:
    coord, _, lease = world
    stranger = NodeIdentity.generate()
    envelope = seal_bundle(build_bundle(lease, stranger), stranger)
    _assert_rejected(coord, envelope, ErrorCode.NODE_UNKNOWN)


def test_banned_node(world) -> None:
    coord, node, lease = world
    envelope = seal_bundle(build_bundle(lease, node), node)
    coord.ban(node.node_id, "cheating")
    _assert_rejected(coord, envelope, ErrorCode.NODE_BANNED)


def test_node_mismatch(world) -> None:
    coord, node, lease = world
    other = register(coord)

    def claim_other(bundle: bundle_pb2.Bundle) -> None:
        bundle.node_id = other.node_id

    _assert_rejected(coord, _mutated(lease, node, claim_other), ErrorCode.NODE_MISMATCH)


def test_model_card_fingerprint_mismatch(world) -> None:
    coord, node, lease = world
    envelope = seal_bundle(build_bundle(lease, node, fingerprint=FP_B), node)
    _assert_rejected(coord, envelope, ErrorCode.MODEL_CARD_MISMATCH)


# -- structure --------------------------------------------------------------------


def _drop_completion(b: bundle_pb2.Bundle) -> None:
    del b.completions[-1]


def _too_long(b: bundle_pb2.Bundle) -> None:
    b.completions[1].token_ids.extend([1] * 11)
    b.completions[1].logprobs.extend([-0.5] * 11)  # 6 + 11 = 17 > 16


def _out_of_vocab(b: bundle_pb2.Bundle) -> None:
    b.completions[2].token_ids[0] = VOCAB


def _negative_token(b: bundle_pb2.Bundle) -> None:
    b.completions[2].token_ids[0] = -1


def _nan(b: bundle_pb2.Bundle) -> None:
    b.completions[0].logprobs[3] = math.nan


def _inf(b: bundle_pb2.Bundle) -> None:
    b.completions[0].logprobs[3] = math.inf


def _neg_inf(b: bundle_pb2.Bundle) -> None:
    b.completions[0].logprobs[3] = -math.inf


def _positive(b: bundle_pb2.Bundle) -> None:
    b.completions[3].logprobs[0] = 0.25


def _count(b: bundle_pb2.Bundle) -> None:
    del b.completions[1].logprobs[-1]


def _empty_text(b: bundle_pb2.Bundle) -> None:
    b.completions[1].text = ""


def _no_tokens(b: bundle_pb2.Bundle) -> None:
    del b.completions[0].token_ids[:]
    del b.completions[0].logprobs[:]


def _no_prompt(b: bundle_pb2.Bundle) -> None:
    del b.prompt_token_ids[:]


def _bad_temperature(b: bundle_pb2.Bundle) -> None:
    b.sampling.temperature = 0.0


def _below_min_logprob(b: bundle_pb2.Bundle) -> None:
    b.completions[0].logprobs[2] = -100.01


def _minus_flt_max(b: bundle_pb2.Bundle) -> None:
    b.completions[0].logprobs[0] = b.completions[0].logprobs[1] = -3.4e38


def _prompt_ids_beyond_the_lease(b: bundle_pb2.Bundle) -> None:
    b.prompt_token_ids.extend([7] * 1000)  # the leased messages allow ~ 500


def _prompt_text_beyond_the_lease(b: bundle_pb2.Bundle) -> None:
    b.prompt_text = "x" * 1000


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (_drop_completion, ErrorCode.GROUP_SIZE_MISMATCH),
        (_too_long, ErrorCode.COMPLETION_TOO_LONG),
        (_out_of_vocab, ErrorCode.TOKEN_OUT_OF_VOCAB),
        (_negative_token, ErrorCode.TOKEN_OUT_OF_VOCAB),
        (_nan, ErrorCode.LOGPROB_NOT_FINITE),
        (_inf, ErrorCode.LOGPROB_NOT_FINITE),
        (_neg_inf, ErrorCode.LOGPROB_NOT_FINITE),
        (_positive, ErrorCode.LOGPROB_POSITIVE),
        (_count, ErrorCode.LOGPROB_COUNT_MISMATCH),
        (_empty_text, ErrorCode.TEXT_MISSING),
        (_no_tokens, ErrorCode.COMPLETION_EMPTY),
        (_no_prompt, ErrorCode.PROMPT_MISSING),
        (_bad_temperature, ErrorCode.SAMPLING_INVALID),
        (_below_min_logprob, ErrorCode.LOGPROB_TOO_SMALL),
        (_minus_flt_max, ErrorCode.LOGPROB_TOO_SMALL),
        (_prompt_ids_beyond_the_lease, ErrorCode.PROMPT_TOO_LONG),
        (_prompt_text_beyond_the_lease, ErrorCode.PROMPT_TOO_LONG),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_structure_rejections(world, mutate, code) -> None:
    coord, node, lease = world
    _assert_rejected(coord, _mutated(lease, node, mutate), code)


def test_bounds_are_inclusive_at_the_limits(world) -> None:
    """-100 nats is accepted; the prompt limit follows the leased messages exactly."""
    from ftis.protocol.bundles import PROMPT_TEMPLATE_SLACK, prompt_limits
    from ftis.tasks import render_messages

    coord, node, lease = world
    contents = [m["content"] for m in render_messages(lease.entry.question)]
    max_ids, max_chars = prompt_limits(contents)
    assert max_ids == sum(len(c.encode()) for c in contents) + PROMPT_TEMPLATE_SLACK
    assert max_chars == sum(len(c) for c in contents) + PROMPT_TEMPLATE_SLACK

    def at_the_limits(b: bundle_pb2.Bundle) -> None:
        b.completions[0].logprobs[2] = -100.0
        b.prompt_token_ids.extend([7] * (max_ids - len(b.prompt_token_ids)))
        b.prompt_text = "x" * max_chars

    assert verify_only(coord, _mutated(lease, node, at_the_limits)).verified_rewards

    def one_more(b: bundle_pb2.Bundle) -> None:
        at_the_limits(b)
        b.prompt_token_ids.append(7)

    _assert_rejected(coord, _mutated(lease, node, one_more), ErrorCode.PROMPT_TOO_LONG)


def test_order_sender_checks_come_before_lease_and_structure(world) -> None:
    coord, node, lease = world
    bundle = build_bundle(lease, node, fingerprint=FP_B)
    bundle.task_id = "unknown"
    bundle.completions[0].logprobs[0] = 1.0
    _assert_rejected(coord, seal_bundle(bundle, node), ErrorCode.MODEL_CARD_MISMATCH)


def test_verify_writes_nothing(world) -> None:
    coord, node, lease = world
    before = snapshot(coord)
    verified = verify_only(coord, seal_bundle(build_bundle(lease, node), node))
    assert verified.verified_rewards == [1.0, 0.0, 1.0, 0.0]
    assert snapshot(coord) == before


# -- re-scoring -------------------------------------------------------------------------


def test_wrong_claims_are_accepted_with_verified_rewards_and_counted(world) -> None:
    coord, node, lease = world
    correct = [True, False, False, True]
    claimed = [0.0, 1.0, 0.0, 1.0]  # first two lie
    bundle = build_bundle(lease, node, correct=correct, claimed=claimed)
    record = coord.submit_bundle(seal_bundle(bundle, node))
    assert record.verified_rewards == [1.0, 0.0, 0.0, 1.0]
    assert record.reward_mismatches == 2
    assert record.mean_reward == 0.5 and not record.zero_variance
    stored = coord.state.list_bundles()[0]
    assert stored.verified_rewards == [1.0, 0.0, 0.0, 1.0] and stored.reward_mismatches == 2
    info = coord.state.get_node(node.node_id)
    assert info.reward_mismatches == 2 and info.bundles_accepted == 1
    assert info.completions == 4 and info.completion_tokens == 4 * 6
    assert coord.state.stats(coord.clock(), 1).bundles_accepted == 1


def test_correct_claims_have_no_mismatch_and_envelope_is_stored_verbatim(world) -> None:
    coord, node, lease = world
    envelope = seal_bundle(build_bundle(lease, node, correct=[True] * 4), node)
    record = coord.submit_bundle(envelope)
    assert record.verified_rewards == [1.0] * 4
    assert record.reward_mismatches == 0 and record.zero_variance
    assert record.envelope == envelope.SerializeToString()
    assert record.fingerprint == FP_A


# -- canonical signed payloads (issue 13, class 7) -------------------------------------------


def _field(number: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2)."""
    from ftis.coordinator.server.convert import _length_delimited

    return _length_delimited(number, data)


def _resealed(node, payload: bytes) -> bundle_pb2.SignedEnvelope:
    from ftis.protocol.envelope import signing_digest

    return bundle_pb2.SignedEnvelope(
        payload_type="bundle", payload=payload, public_key=node.public_key,
        signature=node.sign(signing_digest("bundle", payload)))


def test_unknown_fields_in_the_signed_bundle_are_refused(world) -> None:
    coord, node, lease = world
    bundle = build_bundle(lease, node)
    canonical = bundle.SerializeToString(deterministic=True)
    padded = canonical + _field(99, b"P" * 2048)  # top level
    _assert_rejected(coord, _resealed(node, padded), ErrorCode.PAYLOAD_UNKNOWN_FIELDS)
    # nested: inside the last completion (a repeated field may be split across entries)
    completion = bundle.completions[-1].SerializeToString() + _field(15, b"P" * 2048)
    nested = bundle_pb2.Bundle()
    nested.CopyFrom(bundle)
    del nested.completions[-1]
    payload = nested.SerializeToString(deterministic=True) + _field(9, completion)
    with pytest.raises(FtisError) as info:
        coord.submit_bundle(_resealed(node, payload))
    assert info.value.code == ErrorCode.PAYLOAD_UNKNOWN_FIELDS
    assert "completions[3]" in info.value.reason
    # inside the model card
    card = bundle.model_card.SerializeToString() + _field(40, b"P")
    with pytest.raises(FtisError) as info:
        coord.submit_bundle(_resealed(node, canonical + _field(4, card)))
    assert info.value.code == ErrorCode.PAYLOAD_UNKNOWN_FIELDS
    (event, *_) = coord.evidence(node.node_id)
    assert event.weight < 0 and "PAYLOAD_UNKNOWN_FIELDS" in event.detail


def test_non_canonical_signed_bundle_is_refused(world) -> None:
    """A repeated singular field: the decoder keeps the last copy, the first is padding
    that would be stored and relayed although no check saw it."""
    coord, node, lease = world
    bundle = build_bundle(lease, node)
    canonical = bundle.SerializeToString(deterministic=True)
    padded = _field(8, b"P" * 2048) + canonical  # prompt_text twice, the first 2 KiB
    decoded = bundle_pb2.Bundle.FromString(padded)
    assert decoded == bundle  # nothing a check could see differs
    _assert_rejected(coord, _resealed(node, padded), ErrorCode.PAYLOAD_NOT_CANONICAL)
    assert coord.submit_bundle(_resealed(node, canonical)).bundle_id


def test_stored_envelope_holds_only_the_verified_fields(world) -> None:
    """Unknown fields of the (unsigned) envelope around the payload are not stored or
    relayed: the envelope is re-serialized from its four fields."""
    coord, node, lease = world
    envelope = seal_bundle(build_bundle(lease, node), node)
    clean = envelope.SerializeToString()
    record = coord.submit_bundle(clean + _field(77, b"P" * 4096))
    assert record.envelope == clean and record.size_bytes == len(clean)


def test_registration_rules() -> None:
    clock = FakeClock()
    coord = make_coordinator(clock, register_clock_skew_s=300)
    identity = NodeIdentity.generate()

    def code_of(envelope) -> int:
        with pytest.raises(FtisError) as info:
            coord.register(envelope)
        return info.value.code

    stale = register_envelope(identity, model_card(), clock.now_ms - 301_000)
    assert code_of(stale) == ErrorCode.REGISTRATION_INVALID
    assert code_of(register_envelope(identity, model_card(vocab_size=0), clock.now_ms)) == (
        ErrorCode.REGISTRATION_INVALID
    )
    assert code_of(register_envelope(identity, model_card("abc"), clock.now_ms)) == (
        ErrorCode.REGISTRATION_INVALID
    )
    huge = register_envelope(identity, model_card(vocab_size=2**40), clock.now_ms)
    assert code_of(huge) == ErrorCode.REGISTRATION_INVALID  # beyond MAX_VOCAB_SIZE = 2^22
    payload = swarm_pb2.RegisterPayload.FromString(
        register_envelope(identity, model_card(), clock.now_ms).payload)
    padded_card = payload.model_card.SerializeToString() + b"\xfa\x02\x03abc"  # field 47
    padded = seal("register", payload, identity)
    padded.payload = padded.payload + b"\x0a" + bytes([len(padded_card)]) + padded_card
    padded.signature = identity.sign(signing_digest("register", padded.payload))
    assert code_of(padded) == ErrorCode.PAYLOAD_UNKNOWN_FIELDS
    assert coord.state.list_nodes() == []
    node = coord.register(register_envelope(identity, model_card(), clock.now_ms))
    assert node.node_id == identity.node_id and node.vocab_size == 1000
    clock.advance(5)
    again = coord.register(register_envelope(identity, model_card(FP_B, 2000), clock.now_ms))
    assert (again.fingerprint, again.vocab_size) == (FP_B, 2000)
    assert again.last_seen_ms == clock.now_ms and again.registered_at_ms == node.registered_at_ms
    # capabilities: the known ones are stored, unknown ones (a newer client's) dropped,
    # a registration without any (an older client) stores none; too many or too long:
    # refused, and nothing changes
    assert again.capabilities == ("audit-only-relay",)
    newer = register_envelope(identity, model_card(), clock.now_ms,
                              capabilities=("x-future", "audit-only-relay", "x-future"))
    assert coord.register(newer).capabilities == ("audit-only-relay",)
    older = coord.register(register_envelope(identity, model_card(), clock.now_ms,
                                             capabilities=()))
    assert older.capabilities == ()
    many = register_envelope(identity, model_card(), clock.now_ms,
                             capabilities=tuple(f"c{i}" for i in range(33)))
    assert code_of(many) == ErrorCode.REGISTRATION_INVALID  # MAX_CAPABILITIES = 32
    assert code_of(register_envelope(identity, model_card(), clock.now_ms,
                                     capabilities=("c" * 65,))) == ErrorCode.REGISTRATION_INVALID
    assert coord.register(register_envelope(identity, model_card(), clock.now_ms,
                                            capabilities=tuple(f"c{i}" for i in range(32))
                                            )).capabilities == ()
    coord.ban(identity.node_id)
    assert code_of(register_envelope(identity, model_card(), clock.now_ms)) == ErrorCode.NODE_BANNED


def test_unexpected_exception_becomes_internal_and_server_goes_on(world, caplog) -> None:
    from ftis.coordinator.server.swarm_service import SwarmService
    from ftis.v1 import swarm_pb2

    coord, node, _ = world
    service = SwarmService(coord.ctx)

    def boom(*_args, **_kwargs):
        raise RuntimeError("disk on fire")

    coord.ctx.seen.touch = boom
    real_touch = type(coord.ctx.seen).touch.__get__(coord.ctx.seen)
    request = signed(
        swarm_pb2.HeartbeatRequest(node_id=node.node_id), "Heartbeat", node, coord.clock()
    )
    reply = service.Heartbeat(request, None)
    assert reply.error.code == ErrorCode.INTERNAL and "disk" not in reply.error.reason
    assert "disk on fire" in caplog.text
    coord.ctx.seen.touch = real_touch  # the server goes on serving
    lease_request = swarm_pb2.LeaseTasksRequest(
        node_id=node.node_id, count=1, group_size=2, max_new_tokens=8
    )
    reply = service.LeaseTasks(signed(lease_request, "LeaseTasks", node, coord.clock()), None)
    assert reply.error.code == 0 and len(reply.leases) == 1
