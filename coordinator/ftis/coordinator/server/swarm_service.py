"""Servicer of the volunteer-facing ``ftis.v1.Swarm`` service.

Every rejection travels in-band in the response's ``error`` field (code + one-line
reason); an unexpected exception becomes INTERNAL with its traceback logged, and the
server keeps serving.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ftis.coordinator.server import convert
from ftis.coordinator.service import Coordinator
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import common_pb2, swarm_pb2, swarm_pb2_grpc

log = logging.getLogger(__name__)

R = TypeVar("R")


def in_band_errors(response_cls: type[R]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorator: turn :class:`FtisError` and unexpected exceptions of an RPC handler
    into ``response_cls(error=...)`` (INTERNAL for the latter, traceback logged)."""

    def wrap(handler: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(handler)
        def run(self: Any, request: Any, context: Any) -> R:
            try:
                return handler(self, request, context)
            except FtisError as err:
                return response_cls(error=err.to_proto())  # type: ignore[call-arg]
            except Exception:
                log.exception("internal error in %s", handler.__name__)
                return response_cls(  # type: ignore[call-arg]
                    error=common_pb2.Error(
                        code=ErrorCode.INTERNAL, reason="internal coordinator error"
                    )
                )

        return run

    return wrap


class SwarmService(swarm_pb2_grpc.SwarmServicer):
    """gRPC front of :class:`Coordinator` for volunteers."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    @in_band_errors(swarm_pb2.RegisterResponse)
    def Register(self, request: swarm_pb2.RegisterRequest, context: Any) -> Any:  # noqa: N802
        node = self.coordinator.register(request.envelope)
        return swarm_pb2.RegisterResponse(
            node_id=node.node_id,
            heartbeat_interval_ms=int(self.coordinator.config.heartbeat_interval_s * 1000),
            server_time_ms=self.coordinator.clock(),
        )

    @in_band_errors(swarm_pb2.HeartbeatResponse)
    def Heartbeat(self, request: swarm_pb2.HeartbeatRequest, context: Any) -> Any:  # noqa: N802
        now = self.coordinator.heartbeat(request.node_id, request.policy_version)
        return swarm_pb2.HeartbeatResponse(server_time_ms=now)

    @in_band_errors(swarm_pb2.LeaseTasksResponse)
    def LeaseTasks(self, request: swarm_pb2.LeaseTasksRequest, context: Any) -> Any:  # noqa: N802
        leases = self.coordinator.lease_tasks(
            request.node_id, request.count, request.group_size, request.max_new_tokens
        )
        return swarm_pb2.LeaseTasksResponse(leases=[convert.task_lease(x) for x in leases])

    @in_band_errors(swarm_pb2.SubmitBundleResponse)
    def SubmitBundle(self, request: swarm_pb2.SubmitBundleRequest, context: Any) -> Any:  # noqa: N802
        record = self.coordinator.submit_bundle(request.envelope)
        return swarm_pb2.SubmitBundleResponse(
            bundle_id=record.bundle_id,
            verified_rewards=record.verified_rewards,
            reward_mismatches=record.reward_mismatches,
        )

    @in_band_errors(swarm_pb2.PullBundlesResponse)
    def PullBundles(self, request: swarm_pb2.PullBundlesRequest, context: Any) -> Any:  # noqa: N802
        bundles, next_cursor = self.coordinator.pull_bundles(
            request.node_id,
            request.cursor,
            request.max_bundles,
            request.tokenizer_fingerprint,
            request.skip_zero_variance,
        )
        return swarm_pb2.PullBundlesResponse(
            bundles=[convert.relayed_bundle(b) for b in bundles], next_cursor=next_cursor
        )

    @in_band_errors(swarm_pb2.ReportMetricsResponse)
    def ReportMetrics(self, request: swarm_pb2.ReportMetricsRequest, context: Any) -> Any:  # noqa: N802
        self.coordinator.report_metrics(request.node_id, request.step, dict(request.values))
        return swarm_pb2.ReportMetricsResponse()
