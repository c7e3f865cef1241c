"""Servicer of the operator-facing ``ftis.v1.Admin`` service (separate listener).

Responses with an ``error`` field carry rejections in-band (NODE_UNKNOWN for an unknown
or ambiguous node id prefix; BRANCH_UNKNOWN, BRANCH_INVALID, REQUEST_INVALID for the
branch calls). For responses without one (ListNodes, Stats, ListBundles, ListBranches)
an unexpected exception aborts the call with gRPC status INTERNAL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from ftis.coordinator.handlers import admin
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.server import convert
from ftis.coordinator.server.swarm_service import in_band_errors
from ftis.coordinator.state.base import NodeRecord
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import admin_pb2, admin_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_BUNDLE_LIMIT = 50
MAX_BUNDLE_LIMIT = 1000


def _abort_on_exception(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    def run(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(self, request, context)
        except Exception:
            log.exception("internal error in %s", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, "internal coordinator error")

    return run


class AdminService(admin_pb2_grpc.AdminServicer):
    """gRPC front of the operator handlers (:mod:`ftis.coordinator.handlers.admin`)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def _info(self, node: NodeRecord) -> admin_pb2.NodeInfo:
        return convert.node_info(node, self.ctx.policy, self.ctx.clock())

    @_abort_on_exception
    def ListNodes(self, request: Any, context: Any) -> Any:  # noqa: N802
        nodes = admin.list_nodes(self.ctx)
        return admin_pb2.ListNodesResponse(nodes=[self._info(n) for n in nodes])

    @in_band_errors(admin_pb2.GetNodeResponse)
    def GetNode(self, request: admin_pb2.GetNodeRequest, context: Any) -> Any:  # noqa: N802
        detail = admin.get_node(self.ctx, request.node_id)
        return admin_pb2.GetNodeResponse(
            node=self._info(detail.node),
            rejections_by_code=convert.codes_by_name(detail.rejections_by_code),
            evidence=[convert.evidence(e) for e in detail.evidence],
        )

    @_abort_on_exception
    def Stats(self, request: Any, context: Any) -> Any:  # noqa: N802
        s = admin.stats(self.ctx)
        return admin_pb2.StatsResponse(
            nodes=s.nodes,
            active_nodes=s.active_nodes,
            banned_nodes=s.banned_nodes,
            leases_outstanding=s.leases_outstanding,
            bundles_accepted=s.bundles_accepted,
            bundles_rejected=s.bundles_rejected,
            completions=s.completions,
            completion_tokens=s.completion_tokens,
            mean_verified_reward=s.mean_verified_reward,
            rejections_by_code=convert.codes_by_name(s.rejections_by_code),
            bundle_bytes=s.bundle_bytes,
            quarantined_nodes=s.quarantined_nodes,
        )

    @_abort_on_exception
    def ListBundles(self, request: admin_pb2.ListBundlesRequest, context: Any) -> Any:  # noqa: N802
        limit = request.limit if request.limit > 0 else DEFAULT_BUNDLE_LIMIT
        records = admin.list_bundles(self.ctx, request.node_id, min(limit, MAX_BUNDLE_LIMIT))
        return admin_pb2.ListBundlesResponse(bundles=[convert.bundle_info(b) for b in records])

    @in_band_errors(admin_pb2.BanNodeResponse)
    def BanNode(self, request: admin_pb2.BanNodeRequest, context: Any) -> Any:  # noqa: N802
        node = admin.ban(self.ctx, request.node_id, request.reason)
        return admin_pb2.BanNodeResponse(node=self._info(node))

    @in_band_errors(admin_pb2.UnbanNodeResponse)
    def UnbanNode(self, request: admin_pb2.UnbanNodeRequest, context: Any) -> Any:  # noqa: N802
        node = admin.unban(self.ctx, request.node_id)
        return admin_pb2.UnbanNodeResponse(node=self._info(node))

    @_abort_on_exception
    def GetReputationConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        return admin_pb2.GetReputationConfigResponse(
            config=convert.reputation_config(self.ctx.policy)
        )

    @in_band_errors(admin_pb2.SetReputationConfigResponse)
    def SetReputationConfig(  # noqa: N802
        self, request: admin_pb2.SetReputationConfigRequest, context: Any
    ) -> Any:
        if not request.HasField("config"):
            raise FtisError(ErrorCode.REQUEST_INVALID, "config is required")
        try:
            cfg = convert.reputation_config_from_proto(
                request.config, self.ctx.policy
            )
        except ValueError as exc:
            raise FtisError(ErrorCode.REQUEST_INVALID, str(exc)) from None
        admin.set_reputation_policy(self.ctx, cfg)
        return admin_pb2.SetReputationConfigResponse(config=convert.reputation_config(cfg))

    # -- MERIT branches -----------------------------------------------------------------
    @_abort_on_exception
    def ListBranches(self, request: Any, context: Any) -> Any:  # noqa: N802
        overview = admin.list_branches(self.ctx)
        return admin_pb2.ListBranchesResponse(
            branches=[convert.branch_info(b) for b in overview.branches],
            task_mix=overview.task_mix, unassigned_nodes=overview.unassigned_nodes)

    @in_band_errors(admin_pb2.DefineBranchesResponse)
    def DefineBranches(  # noqa: N802
        self, request: admin_pb2.DefineBranchesRequest, context: Any
    ) -> Any:
        if not request.branches and not request.replace:
            raise FtisError(ErrorCode.REQUEST_INVALID, "no branch given")
        branches = admin.define_branches(
            self.ctx, [convert.branch_from_proto(b) for b in request.branches],
            replace=request.replace)
        return admin_pb2.DefineBranchesResponse(
            branches=[convert.branch_info(b) for b in branches])

    @in_band_errors(admin_pb2.AssignBranchResponse)
    def AssignBranch(  # noqa: N802
        self, request: admin_pb2.AssignBranchRequest, context: Any
    ) -> Any:
        if request.round_robin:
            if request.node_ids or request.branch:
                raise FtisError(ErrorCode.REQUEST_INVALID,
                                "round_robin takes no node ids and no branch")
            nodes = admin.assign_round_robin(self.ctx)
        else:
            nodes = admin.assign_branch(self.ctx, list(request.node_ids),
                                        request.branch or None)
        return admin_pb2.AssignBranchResponse(assignments=[
            admin_pb2.NodeBranch(node_id=n.node_id, branch=n.branch or "") for n in nodes])
