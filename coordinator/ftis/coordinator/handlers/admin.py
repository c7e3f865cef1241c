"""Operator handlers: reads for the admin service and the operator's actions."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import REPUTATION_SETTING, Context
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.state.base import (
    BranchRecord,
    BundleRecord,
    EvidenceRecord,
    NodeRecord,
    StatsRecord,
)
from ftis.protocol.errors import ErrorCode, FtisError

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


def audit_bootstrap_problem(ctx: Context, cfg: ReputationConfig) -> str | None:
    """Why ``cfg``'s audit-based probation could never end for anyone in this swarm, or
    ``None`` (:func:`reputation.audit_bootstrap_problem` over the configured seeds, the
    held spot-check models and the stored nodes' audits)."""
    seeds, holds = len(ctx.config.audit_seed_nodes), ctx.config.spot_checks.enabled
    if reputation.audit_bootstrap_problem(cfg, seeds, holds, passed_audits=0) is None:
        return None  # off, or a configured bootstrap: no need to read every node
    passed = sum(1 for n in ctx.state.list_nodes()
                 if n.audit_status == reputation.AUDIT_PASSED)
    return reputation.audit_bootstrap_problem(cfg, seeds, holds, passed)


def set_reputation_policy(ctx: Context, cfg: ReputationConfig) -> ReputationConfig:
    """Persist a new policy (``settings`` row; other worker processes reload it within
    a few seconds) and re-evaluate every node's quarantine flag under it.

    Raises:
        FtisError: REQUEST_INVALID when ``cfg`` turns on audit-based probation with no
            bootstrap (:func:`audit_bootstrap_problem`); nothing is changed.
    """
    problem = audit_bootstrap_problem(ctx, cfg)
    if problem is not None:
        raise FtisError(ErrorCode.REQUEST_INVALID, problem)
    now = ctx.clock()
    ctx.state.put_setting(REPUTATION_SETTING, json.dumps(cfg.to_dict()), now)
    ctx.policy = cfg
    for node in ctx.state.list_nodes():
        ctx.state.apply_evidence(node.node_id, [], now,
                                 reputation.standing_update([], now, cfg))
    log.warning("reputation policy changed: %s", cfg)
    return cfg


# -- MERIT branches (issue 16; docs/merit.md, docs/operators.md) --------------------------


@dataclass(frozen=True)
class BranchOverview:
    """The branches (with their nodes and accepted bundles), the task mix's datasets in
    mix order, and how many registered nodes are leased from the whole mix."""

    branches: list[BranchRecord]
    task_mix: list[str]
    unassigned_nodes: int


def task_mix(ctx: Context) -> list[str]:
    """The datasets of the coordinator's task mix, in mix order, each once."""
    return list(dict.fromkeys(spec.dataset for spec in ctx.config.tasks))


def list_branches(ctx: Context) -> BranchOverview:
    """Every branch by name, with the mix and the count of unassigned nodes."""
    branches = ctx.state.list_branches()
    nodes = ctx.state.swarm_counts(ctx.clock(), ACTIVE_WINDOW_MS).nodes
    assigned = sum(len(b.node_ids) for b in branches)
    return BranchOverview(branches, task_mix(ctx), max(0, nodes - assigned))


def define_branches(ctx: Context, branches: Sequence[BranchRecord],
                    replace: bool = False) -> list[BranchRecord]:
    """Define (or redefine) ``branches``; with ``replace``, drop every other branch and
    unassign its nodes (:meth:`State.define_branches`; ``replace`` with no branches
    drops them all). Every family must be a dataset of the task mix (``config.tasks``).
    Returns every branch after the change.

    Raises:
        FtisError: BRANCH_INVALID (a family not in the mix, or see
            :func:`~ftis.coordinator.state.base.check_branches`).
    """
    mix = task_mix(ctx)
    for b in branches:
        for family in b.families:
            if family not in mix:
                raise FtisError(ErrorCode.BRANCH_INVALID,
                                f"branch {b.name[:64]}: family {family[:128]!r} is not in the "
                                f"coordinator's task mix ({', '.join(mix)})")
    try:
        result = ctx.state.define_branches(branches, ctx.clock(), replace=replace)
    finally:
        ctx.branches.drop()
    log.warning("branches %s: %s", "replaced" if replace else "defined",
                "; ".join(f"{b.name}={','.join(b.families)}" for b in branches) or "none")
    return result


def assign_branch(ctx: Context, node_ids: Sequence[str], branch: str | None
                  ) -> list[NodeRecord]:
    """Assign the nodes (full ids or unique prefixes) to ``branch``, or unassign them
    (``None``: the whole mix again), all or none. Their next lease in this process
    follows at once; in other worker processes within a second (node records are
    cached that long).

    Raises:
        FtisError: NODE_UNKNOWN, BRANCH_UNKNOWN, REQUEST_INVALID (no node given).
    """
    if not node_ids:
        raise FtisError(ErrorCode.REQUEST_INVALID, "no node given")
    resolved = [ctx.state.resolve_node(n).node_id for n in node_ids]
    return _assign(ctx, dict.fromkeys(resolved, branch))


def assign_round_robin(ctx: Context) -> list[NodeRecord]:
    """Spread every registered node that is neither assigned nor banned over the
    branches: each, oldest registration first, goes to the branch with the fewest
    nodes (ties: the first by name). Returns the nodes assigned (``[]`` if none was
    unassigned).

    Raises:
        FtisError: BRANCH_INVALID when no branch is defined.
    """
    branches = ctx.state.list_branches()
    if not branches:
        raise FtisError(ErrorCode.BRANCH_INVALID,
                        "no branch defined: ftis-admin branches plan PLAN.json --apply")
    load = {b.name: len(b.node_ids) for b in branches}
    plan: dict[str, str | None] = {}
    for node in ctx.state.list_nodes():
        if node.branch is None and not node.banned:
            name = min(load, key=lambda n: (load[n], n))
            plan[node.node_id] = name
            load[name] += 1
    return _assign(ctx, plan)


def _assign(ctx: Context, plan: dict[str, str | None]) -> list[NodeRecord]:
    try:
        nodes = ctx.state.assign_branches(plan)
    finally:
        for node_id in plan:
            ctx.nodes.drop(node_id)
    if nodes:
        log.warning("%d node(s) assigned: %s", len(nodes), ", ".join(
            f"{n.node_id[:12]}->{n.branch or '(whole mix)'}" for n in nodes[:20]))
    return nodes
