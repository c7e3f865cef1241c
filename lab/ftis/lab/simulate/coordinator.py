"""The coordinator side of a simulated swarm: ``ftis-coordinator``'s own code over
in-process state, driven by the ServerApp (no ``flwr`` here).

Registration and bundle submission go through the coordinator's gRPC servicer object
(:class:`~ftis.coordinator.server.swarm_service.SwarmService`) called in-process, so
signed envelopes are opened, verified (:mod:`ftis.coordinator.verify`, tokenizer text
check and re-scoring included), stored with their reputation evidence and answered
exactly as over gRPC. Heartbeats, leases, relay pages and metric reports call the same
handlers (:mod:`ftis.coordinator.handlers`) the servicer calls after authenticating a
signed request; inside one simulation the server knows which ClientApp answered, so
those requests are not signed (every bundle still is).

Every answer is the serialized ``ftis.v1`` response message the servicer would send,
with a coordinator refusal in its ``error`` field.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

from ftis.coordinator import reputation
from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.handlers import feedback, leases, nodes, relay
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.server import convert
from ftis.coordinator.server.swarm_service import SwarmService
from ftis.coordinator.state.base import NodeRecord
from ftis.coordinator.state.sql import SqlState
from ftis.coordinator.verify import check_node_record
from ftis.protocol.errors import FtisError
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)

#: Bundles per relay page a learner asks for (the client's ``PULL_PAGE``).
PULL_PAGE = 64

M = TypeVar("M", bound=Message)


def _answer(response_cls: type[M], call: Callable[[], M]) -> M:
    """``call()``, or ``response_cls`` carrying the :class:`FtisError` it raised."""
    try:
        return call()
    except FtisError as err:
        return response_cls(error=err.to_proto())  # type: ignore[call-arg]


@dataclass(frozen=True)
class PullPlan:
    """What a learner pulls this round: from ``cursor``, bundles of ``fingerprint`` ("":
    every tokenizer family); ``wanted`` False: nothing (no external groups)."""

    wanted: bool
    cursor: int
    fingerprint: str


@dataclass(frozen=True)
class NodeTotals:
    """The coordinator's end state for one swarm.

    Attributes:
        bundles_accepted, bundles_rejected: over all learners.
        verified_rewards: per node id, verified rewards of its stored bundles, oldest
            first (floats in [0, 1]).
        reputations: per node id, its reputation score in [0, 1] now.
    """

    bundles_accepted: int
    bundles_rejected: int
    verified_rewards: dict[str, list[float]]
    reputations: dict[str, float]


def totals(ctx: Context, node_ids: list[str]) -> NodeTotals:
    """:class:`NodeTotals` of ``node_ids`` read from ``ctx``'s state."""
    now = ctx.clock()
    accepted = rejected = 0
    rewards: dict[str, list[float]] = {}
    scores: dict[str, float] = {}
    for node_id in node_ids:
        record = ctx.state.get_node(node_id)
        if record is None:
            continue
        accepted += record.bundles_accepted
        rejected += record.bundles_rejected
        stored = sorted(ctx.state.list_bundles(node_id, 1 << 30), key=lambda b: b.sequence)
        rewards[node_id] = [float(r) for b in stored for r in b.verified_rewards]
        scores[node_id] = reputation.current_score(record.standing, now,
                                                   ctx.policy.half_life_s)
    return NodeTotals(accepted, rejected, rewards, scores)


class SimCoordinator:
    """``ftis-coordinator``'s handlers over one in-process :class:`SqlState`.

    Args:
        config: the coordinator's configuration (its ``db``: a SQLite path, or
            ``sqlite://`` in memory; listeners are never bound).
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.state = SqlState(config.db_url, task_block=config.task_number_block)
        self.ctx = Context.create(config, self.state)
        self.service = SwarmService(self.ctx)

    def close(self) -> None:
        """Write buffered last-seen times and release the database."""
        self.ctx.seen.flush(self.state)
        self.ctx.rescoring.close()
        self.state.close()

    def node(self, node_id: str) -> NodeRecord:
        """The registered, unbanned node (FtisError NODE_UNKNOWN / NODE_BANNED)."""
        return check_node_record(self.state.get_node(node_id), node_id)

    def register(self, envelope: bytes, fingerprint: str, tokenizer_gz: bytes) -> bytes:
        """A learner's RegisterRequest envelope (serialized ``SignedEnvelope``), then its
        tokenizer when the coordinator does not know it yet; returns the serialized
        ``RegisterResponse`` (refusals in ``error``; an upload refusal too)."""
        request = swarm_pb2.RegisterRequest(envelope=bundle_pb2.SignedEnvelope.FromString(
            envelope))
        response = self.service.Register(request, None)
        if not response.error.code and not response.tokenizer_known:
            try:
                nodes.upload_tokenizer(self.ctx, self.node(response.node_id), fingerprint,
                                       tokenizer_gz)
                response.tokenizer_known = True
            except FtisError as err:
                response.error.CopyFrom(err.to_proto())
        return bytes(response.SerializeToString())

    def heartbeat(self, node_id: str, policy_version: int) -> bytes:
        """Serialized ``HeartbeatResponse`` (server time, reputation now, quarantine)."""
        def call() -> swarm_pb2.HeartbeatResponse:
            node = self.node(node_id)
            now, score = nodes.heartbeat(self.ctx, node, policy_version)
            return swarm_pb2.HeartbeatResponse(server_time_ms=now, reputation=score,
                                               quarantined=node.quarantined)
        return bytes(_answer(swarm_pb2.HeartbeatResponse, call).SerializeToString())

    def lease(self, node_id: str, count: int, group_size: int, max_new_tokens: int) -> bytes:
        """Serialized ``LeaseTasksResponse``: ``count`` tasks under fresh leases."""
        def call() -> swarm_pb2.LeaseTasksResponse:
            granted = leases.lease_tasks(self.ctx, self.node(node_id), count, group_size,
                                         max_new_tokens)
            return swarm_pb2.LeaseTasksResponse(leases=[convert.task_lease(x)
                                                        for x in granted])
        return bytes(_answer(swarm_pb2.LeaseTasksResponse, call).SerializeToString())

    def submit(self, envelope: bytes) -> bytes:
        """One signed bundle (serialized ``SignedEnvelope``) through the servicer's
        SubmitBundle: verified, stored with its evidence or refused; returns the
        serialized ``SubmitBundleResponse`` (verified rewards, or ``error``)."""
        request = swarm_pb2.SubmitBundleRequest(
            envelope=bundle_pb2.SignedEnvelope.FromString(envelope))
        return bytes(self.service.SubmitBundle(request, None).SerializeToString())

    def pull(self, node_id: str, plan: PullPlan) -> list[bytes]:
        """Every relay page ``node_id`` gets from ``plan.cursor`` on, as the client's
        page loop would fetch them (pages of :data:`PULL_PAGE`, zero-variance groups
        skipped, until a page is short): serialized ``PullBundlesResponse`` each; a
        refusal ends the list with a response carrying ``error``."""
        if not plan.wanted:
            return []
        pages: list[bytes] = []
        cursor = plan.cursor
        while True:
            try:
                page = relay.pull_bundles(self.ctx, self.node(node_id), cursor, PULL_PAGE,
                                          plan.fingerprint, skip_zero_variance=True)
            except FtisError as err:
                pages.append(swarm_pb2.PullBundlesResponse(error=err.to_proto())
                             .SerializeToString())
                return pages
            pages.append(convert.relay_page_bytes(page))
            cursor = max([cursor, page.next_cursor, *(b.sequence for b in page.bundles)])
            if len(page.bundles) < PULL_PAGE:
                return pages

    def report(self, node_id: str, request: bytes) -> int:
        """A learner's ``ReportMetricsRequest`` (serialized) through the feedback
        handler; returns the number of feedback entries dropped (-1: refused)."""
        message = swarm_pb2.ReportMetricsRequest.FromString(request)
        try:
            dropped = feedback.report_metrics(self.ctx, self.node(node_id), message.step,
                                              dict(message.values), list(message.feedback))
        except FtisError as err:
            log.warning("metrics of %s refused: %s", node_id[:12], err)
            return -1
        return len(dropped)

    def totals(self, node_ids: list[str]) -> NodeTotals:
        """:func:`totals` of this coordinator."""
        self.ctx.seen.flush(self.state)
        return totals(self.ctx, node_ids)
