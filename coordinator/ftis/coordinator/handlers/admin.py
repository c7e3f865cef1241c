"""Operator handlers: reads for the admin service and the operator's actions."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import REPUTATION_SETTING, Context
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.state.base import BundleRecord, EvidenceRecord, NodeRecord, StatsRecord

log = logging.getLogger(__name__)

#: A node seen within this window counts as active in Stats.
ACTIVE_WINDOW_MS = 5 * 60 * 1000
#: Evidence rows returned by GetNode.
EVIDENCE_SHOWN = 50


@dataclass(frozen=True)
class NodeDetail:
    """One node for the operator: the record, its rejections by code and newest evidence."""

    node: NodeRecord
    rejections_by_code: dict[int, int]
    evidence: list[EvidenceRecord]


def list_nodes(ctx: Context) -> list[NodeRecord]:
    """Every registered node (this process's buffered last-seen times written first;
    other worker processes' are at most ``SEEN_FLUSH_S`` old)."""
    ctx.seen.flush(ctx.state)
    return ctx.state.list_nodes()


def get_node(ctx: Context, id_or_prefix: str, evidence_limit: int = EVIDENCE_SHOWN) -> NodeDetail:
    """A node by full id or unique prefix. Raises FtisError NODE_UNKNOWN."""
    ctx.seen.flush(ctx.state)
    node = ctx.state.resolve_node(id_or_prefix)
    return NodeDetail(node, ctx.state.rejections_by_code(node.node_id),
                      ctx.state.list_evidence(node.node_id, evidence_limit))


def evidence(ctx: Context, node_id: str, limit: int = EVIDENCE_SHOWN) -> list[EvidenceRecord]:
    """A node's newest evidence rows."""
    return ctx.state.list_evidence(node_id, limit)


def stats(ctx: Context) -> StatsRecord:
    """Swarm-wide counters (active = seen within :data:`ACTIVE_WINDOW_MS`)."""
    ctx.seen.flush(ctx.state)  # last-seen times are buffered
    return ctx.state.stats(ctx.clock(), ACTIVE_WINDOW_MS)


def list_bundles(ctx: Context, node_prefix: str, limit: int) -> list[BundleRecord]:
    """Newest stored bundles (of nodes whose id starts with ``node_prefix``)."""
    return ctx.state.list_bundles(node_prefix, limit)


def reputation_of(ctx: Context, node: NodeRecord) -> float:
    """The node's score now (evidence decayed to the current time)."""
    return reputation.current_score(node.standing, ctx.clock(), ctx.policy.half_life_s)


def ban(ctx: Context, id_or_prefix: str, reason: str = "") -> NodeRecord:
    """Ban a node (full id or unique prefix): its calls are refused and its bundles no
    longer relayed. Raises FtisError NODE_UNKNOWN."""
    node = ctx.state.resolve_node(id_or_prefix)
    log.warning("banning node %s: %s", node.node_id, reason)
    ctx.nodes.drop(node.node_id)
    return ctx.state.set_ban(node.node_id, True, reason or "banned by operator")


def unban(ctx: Context, id_or_prefix: str) -> NodeRecord:
    """Lift a ban and clear quarantine: the node's bad evidence is reset to 0 (its good
    evidence is kept; an ``operator_reset`` evidence row records it).
    Raises FtisError NODE_UNKNOWN."""
    node = ctx.state.resolve_node(id_or_prefix)
    log.warning("unbanning node %s", node.node_id)
    ctx.nodes.drop(node.node_id)
    ctx.state.set_ban(node.node_id, False, "")
    return ctx.state.reset_bad_evidence(node.node_id, ctx.clock())


def set_reputation_policy(ctx: Context, cfg: ReputationConfig) -> ReputationConfig:
    """Persist a new policy (``settings`` row; other worker processes reload it within
    a few seconds) and re-evaluate every node's quarantine flag under it."""
    now = ctx.clock()
    ctx.state.put_setting(REPUTATION_SETTING, json.dumps(cfg.to_dict()), now)
    ctx.policy = cfg
    for node in ctx.state.list_nodes():
        ctx.state.apply_evidence(node.node_id, [], now,
                                 reputation.standing_update([], now, cfg))
    log.warning("reputation policy changed: %s", cfg)
    return cfg
