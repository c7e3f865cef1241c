"""Conversions from state records to ``ftis.v1`` messages."""

from __future__ import annotations

import dataclasses

from ftis.coordinator import reputation
from ftis.coordinator.handlers.relay import RelayPage
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.state.base import (
    BranchRecord,
    BundleRecord,
    EvidenceRecord,
    LeaseRecord,
    NodeRecord,
)
from ftis.protocol.errors import code_name
from ftis.tasks import render_messages
from ftis.v1 import admin_pb2, bundle_pb2, common_pb2, swarm_pb2


def task_lease(lease: LeaseRecord) -> swarm_pb2.TaskLease:
    """The ``TaskLease`` sent to the node (prompt rendered as chat messages).

    It carries the question and nothing of the answer: no ReasoningGYM entry, answer or
    metadata (which holds the answer for tasks such as ``gcd``) leaves the coordinator
    (docs/threat-model.md "Ground truth stays on the coordinator").
    """
    return swarm_pb2.TaskLease(
        lease_id=lease.lease_id,
        task_id=lease.task_id,
        dataset=lease.dataset,
        messages=[
            common_pb2.ChatMessage(role=m["role"], content=m["content"])
            for m in render_messages(lease.entry.question)
        ],
        question=lease.entry.question,
        deadline_ms=lease.deadline_ms,
        group_size=lease.group_size,
        max_new_tokens=lease.max_new_tokens,
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field_number: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2): tag, length, ``data``."""
    return _varint(field_number << 3 | 2) + _varint(len(data)) + data


#: Field numbers in swarm.proto: ``RelayedBundle.envelope`` and
#: ``PullBundlesResponse.bundles`` (a test checks them against the descriptors).
RELAYED_ENVELOPE_FIELD = 3
PULL_BUNDLES_FIELD = 2


def relayed_bundle_bytes(record: BundleRecord, sender_reputation: float) -> bytes:
    """A stored bundle as a serialized ``RelayedBundle``: the envelope goes out exactly
    as stored (and as the sender signed it), without being parsed again. Protobuf
    parsers accept fields in any order, so the envelope is appended after the rest."""
    head = swarm_pb2.RelayedBundle(
        sequence=record.sequence,
        bundle_id=record.bundle_id,
        verified_rewards=record.verified_rewards,
        stored_at_ms=record.stored_at_ms,
        sender_reputation=sender_reputation,
        task_question=record.question,
        audit_only=record.audit_only,
    ).SerializeToString()
    return head + _length_delimited(RELAYED_ENVELOPE_FIELD, record.envelope)


def relay_page_bytes(page: RelayPage) -> bytes:
    """A serialized ``PullBundlesResponse`` for ``page`` (see :func:`relayed_bundle_bytes`)."""
    parts = [_length_delimited(PULL_BUNDLES_FIELD, relayed_bundle_bytes(b, r))
             for b, r in zip(page.bundles, page.sender_reputations, strict=True)]
    parts.append(swarm_pb2.PullBundlesResponse(next_cursor=page.next_cursor).SerializeToString())
    return b"".join(parts)


def relayed_bundle(record: BundleRecord, sender_reputation: float) -> swarm_pb2.RelayedBundle:
    """:func:`relayed_bundle_bytes` as a message (for tests and tools)."""
    return swarm_pb2.RelayedBundle.FromString(relayed_bundle_bytes(record, sender_reputation))


def node_info(
    node: NodeRecord, cfg: ReputationConfig | None = None, now_ms: int | None = None
) -> admin_pb2.NodeInfo:
    """Admin view of a node; reputation evidence decayed to ``now_ms`` (default: as
    stored) under ``cfg`` (default: the built-in policy)."""
    cfg = cfg if cfg is not None else ReputationConfig()
    now_ms = now_ms if now_ms is not None else node.rep_updated_ms
    good, bad = reputation.decayed(node.standing, now_ms, cfg.half_life_s)
    card = bundle_pb2.ModelCard()
    card.ParseFromString(node.model_card)
    return admin_pb2.NodeInfo(
        node_id=node.node_id,
        display_name=node.display_name,
        model_card=card,
        registered_at_ms=node.registered_at_ms,
        last_seen_ms=node.last_seen_ms,
        banned=node.banned,
        ban_reason=node.ban_reason,
        policy_version=node.policy_version,
        bundles_accepted=node.bundles_accepted,
        bundles_rejected=node.bundles_rejected,
        reward_mismatches=node.reward_mismatches,
        latest_metrics=node.latest_metrics,
        latest_metrics_step=node.latest_metrics_step,
        reputation=reputation.score(good, bad),
        evidence_good=good,
        evidence_bad=bad,
        quarantined=node.quarantined,
        probation=reputation.in_probation(node.bundles_accepted, node.audit_status, cfg),
        branch=node.branch or "",
    )


def branch_info(branch: BranchRecord) -> admin_pb2.BranchInfo:
    """Admin view of a MERIT branch."""
    return admin_pb2.BranchInfo(
        name=branch.name, families=list(branch.families), tokens=branch.tokens,
        defined_at_ms=branch.defined_at_ms, node_ids=list(branch.node_ids),
        bundles_accepted=branch.bundles_accepted)


def branch_from_proto(info: admin_pb2.BranchInfo) -> BranchRecord:
    """A branch to define from its message (name, families and tokens are read)."""
    return BranchRecord(name=info.name, families=tuple(info.families), tokens=info.tokens)


def evidence(record: EvidenceRecord) -> admin_pb2.Evidence:
    """Admin view of one evidence row."""
    return admin_pb2.Evidence(
        at_ms=record.at_ms,
        kind=record.kind,
        weight=record.weight,
        detail=record.detail,
        reporter_node_id=record.reporter_node_id,
        bundle_id=record.bundle_id,
    )


#: The policy's settable fields: every :class:`ReputationConfig` field (the admin message
#: has one of the same name for each; ``tests/unit/test_observe.py`` checks).
REPUTATION_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ReputationConfig))


def reputation_config(cfg: ReputationConfig) -> admin_pb2.ReputationConfig:
    """The whole policy as the admin message (every field set)."""
    return admin_pb2.ReputationConfig(**{name: getattr(cfg, name) for name in REPUTATION_FIELDS})


def reputation_config_from_proto(
    message: admin_pb2.ReputationConfig, base: ReputationConfig
) -> ReputationConfig:
    """``base`` with the fields set in ``message`` replaced (fields left unset keep
    ``base``'s value).

    Raises:
        ValueError: out-of-range values.
    """
    return base.updated(**{name: getattr(message, name) for name in REPUTATION_FIELDS
                           if message.HasField(name)})


def bundle_info(record: BundleRecord) -> admin_pb2.BundleInfo:
    """Admin view of a stored bundle (no envelope)."""
    return admin_pb2.BundleInfo(
        sequence=record.sequence,
        bundle_id=record.bundle_id,
        node_id=record.node_id,
        task_id=record.task_id,
        dataset=record.dataset,
        completions=record.completions,
        completion_tokens=record.completion_tokens,
        mean_verified_reward=record.mean_reward,
        policy_version=record.policy_version,
        stored_at_ms=record.stored_at_ms,
        size_bytes=record.size_bytes,
        reward_mismatches=record.reward_mismatches,
    )


def codes_by_name(counts: dict[int, int]) -> dict[str, int]:
    """``{code: n}`` -> ``{"CODE_NAME": n}``."""
    return {code_name(code): n for code, n in counts.items()}
