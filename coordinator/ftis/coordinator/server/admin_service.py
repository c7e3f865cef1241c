"""Servicer of the operator-facing ``ftis.v1.Admin`` service (separate listener).

Responses with an ``error`` field carry rejections in-band (NODE_UNKNOWN for an unknown
or ambiguous node id prefix). For responses without one (ListNodes, Stats,
ListBundles) an unexpected exception aborts the call with gRPC status INTERNAL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from ftis.coordinator.server import convert
from ftis.coordinator.server.swarm_service import in_band_errors
from ftis.coordinator.service import ACTIVE_WINDOW_MS, Coordinator
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
    """gRPC front of the operator operations of :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.state = coordinator.state

    def _info(self, node: NodeRecord) -> admin_pb2.NodeInfo:
        return convert.node_info(node, self.coordinator.reputation_config, self.coordinator.clock())

    @_abort_on_exception
    def ListNodes(self, request: Any, context: Any) -> Any:  # noqa: N802
        return admin_pb2.ListNodesResponse(nodes=[self._info(n) for n in self.state.list_nodes()])

    @in_band_errors(admin_pb2.GetNodeResponse)
    def GetNode(self, request: admin_pb2.GetNodeRequest, context: Any) -> Any:  # noqa: N802
        node = self.state.resolve_node(request.node_id)
        return admin_pb2.GetNodeResponse(
            node=self._info(node),
            rejections_by_code=convert.codes_by_name(self.state.rejections_by_code(node.node_id)),
            evidence=[convert.evidence(e) for e in self.coordinator.evidence(node.node_id)],
        )

    @_abort_on_exception
    def Stats(self, request: Any, context: Any) -> Any:  # noqa: N802
        s = self.state.stats(self.coordinator.clock(), ACTIVE_WINDOW_MS)
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
        records = self.state.list_bundles(request.node_id, min(limit, MAX_BUNDLE_LIMIT))
        return admin_pb2.ListBundlesResponse(bundles=[convert.bundle_info(b) for b in records])

    @in_band_errors(admin_pb2.BanNodeResponse)
    def BanNode(self, request: admin_pb2.BanNodeRequest, context: Any) -> Any:  # noqa: N802
        node = self.coordinator.ban(request.node_id, request.reason)
        return admin_pb2.BanNodeResponse(node=self._info(node))

    @in_band_errors(admin_pb2.UnbanNodeResponse)
    def UnbanNode(self, request: admin_pb2.UnbanNodeRequest, context: Any) -> Any:  # noqa: N802
        node = self.coordinator.unban(request.node_id)
        return admin_pb2.UnbanNodeResponse(node=self._info(node))

    @_abort_on_exception
    def GetReputationConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        return admin_pb2.GetReputationConfigResponse(
            config=convert.reputation_config(self.coordinator.reputation_config)
        )

    @in_band_errors(admin_pb2.SetReputationConfigResponse)
    def SetReputationConfig(  # noqa: N802
        self, request: admin_pb2.SetReputationConfigRequest, context: Any
    ) -> Any:
        if not request.HasField("config"):
            raise FtisError(ErrorCode.REQUEST_INVALID, "config is required")
        try:
            cfg = convert.reputation_config_from_proto(
                request.config, self.coordinator.reputation_config
            )
        except ValueError as exc:
            raise FtisError(ErrorCode.REQUEST_INVALID, str(exc)) from None
        self.coordinator.set_reputation_config(cfg)
        return admin_pb2.SetReputationConfigResponse(config=convert.reputation_config(cfg))
