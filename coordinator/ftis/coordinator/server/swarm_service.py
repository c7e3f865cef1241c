"""Servicer of the volunteer-facing ``ftis.v1.Swarm`` service.

Every rejection travels in-band in the response's ``error`` field (code + one-line
reason); an unexpected exception becomes INTERNAL with its traceback logged, and the
server keeps serving.

Signed requests (Heartbeat, LeaseTasks, PullBundles, ReportMetrics, UploadTokenizer) are
authenticated once, by the ``authenticated`` decorator (:func:`nodes.authenticate`:
NODE_UNKNOWN → AUTH_INVALID / AUTH_EXPIRED → NODE_BANNED), which hands the node record to
the handler. Relay pages are written as wire bytes around the stored envelopes, which are
never re-parsed (:func:`convert.relay_page_bytes`).

:func:`add_swarm_service` registers the servicer so that each method gets the raw bytes,
checked *before* decoding (in the event loop of the ``grpc.aio`` server, before the
handler runs, on the loop or in its thread pool): a connection over its refusal budget is answered
RATE_LIMITED after a delay (:class:`~ftis.coordinator.quotas.ConnectionBudget`), larger
requests than the method's limit REQUEST_TOO_LARGE, and undecodable ones REQUEST_INVALID,
all in-band
(the transport-level ``max_receive_message_length`` still answers even larger messages
with gRPC status RESOURCE_EXHAUSTED).

Metrics (:mod:`ftis.coordinator.observe.metrics`) are taken here: every registered
method's time and in-band code (``_refusing_async`` / ``_refusing``, which also see
REQUEST_TOO_LARGE), the
SubmitBundle outcome by code, the SubmitBundle handler's time, leases issued and bundles
relayed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from sqlalchemy.util import greenlet_spawn

from ftis.coordinator.handlers import bundles, feedback, leases, nodes, relay
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.observe import metrics
from ftis.coordinator.quotas import ConnectionBudget, peer_host
from ftis.coordinator.server import convert
from ftis.coordinator.state.base import NodeRecord
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


def authenticated(method: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorator for signed requests: authenticate once (:func:`nodes.authenticate`, one
    database read) and hand the :class:`NodeRecord` to the RPC handler as ``node``."""

    def wrap(handler: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(handler)
        def run(self: SwarmService, request: Any, context: Any) -> R:
            node = nodes.authenticate(self.ctx, request, method)
            return handler(self, request, context, node)

        return run

    return wrap


def _connection(context: Any) -> str:
    """The caller's connection (``context.peer()``: ``ipv4:HOST:PORT``); "" for none."""
    try:
        return str(context.peer()) if context is not None else ""
    except Exception:  # a test double without peer()
        return ""


def _peer(context: Any) -> str:
    """The caller's host (:func:`quotas.peer_host` of its connection)."""
    return peer_host(_connection(context))


class SwarmService(swarm_pb2_grpc.SwarmServicer):
    """gRPC front of the volunteer handlers: translate, call, translate back."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    @in_band_errors(swarm_pb2.RegisterResponse)
    def Register(self, request: swarm_pb2.RegisterRequest, context: Any) -> Any:  # noqa: N802
        node = nodes.register(self.ctx, request.envelope, peer=_peer(context))
        return swarm_pb2.RegisterResponse(
            node_id=node.node_id,
            heartbeat_interval_ms=int(self.ctx.config.heartbeat_interval_s * 1000),
            server_time_ms=self.ctx.clock(),
            tokenizer_known=nodes.tokenizer_known(self.ctx, node.fingerprint),
        )

    @in_band_errors(swarm_pb2.HeartbeatResponse)
    @authenticated("Heartbeat")
    def Heartbeat(self, request: swarm_pb2.HeartbeatRequest, context: Any,  # noqa: N802
                  node: NodeRecord) -> Any:
        now, score = nodes.heartbeat(self.ctx, node, request.policy_version)
        return swarm_pb2.HeartbeatResponse(server_time_ms=now, reputation=score,
                                           quarantined=node.quarantined)

    @in_band_errors(swarm_pb2.LeaseTasksResponse)
    @authenticated("LeaseTasks")
    def LeaseTasks(self, request: swarm_pb2.LeaseTasksRequest, context: Any,  # noqa: N802
                   node: NodeRecord) -> Any:
        granted = leases.lease_tasks(self.ctx, node, request.count, request.group_size,
                                     request.max_new_tokens)
        metrics.leases_issued(len(granted))
        return swarm_pb2.LeaseTasksResponse(leases=[convert.task_lease(x) for x in granted])

    @in_band_errors(swarm_pb2.SubmitBundleResponse)
    def SubmitBundle(self, request: swarm_pb2.SubmitBundleRequest, context: Any) -> Any:  # noqa: N802
        started = time.perf_counter()
        try:
            record = bundles.submit_bundle(self.ctx, request.envelope)
        except bundles.ReplayedBundle as err:  # the stored acknowledgement, with the code
            metrics.observe_verification(time.perf_counter() - started, accepted=False)
            if err.stored is None:
                raise
            return swarm_pb2.SubmitBundleResponse(
                error=err.to_proto(), bundle_id=err.stored.bundle_id,
                verified_rewards=err.stored.verified_rewards,
                reward_mismatches=err.stored.reward_mismatches)
        except BaseException:
            metrics.observe_verification(time.perf_counter() - started, accepted=False)
            raise
        metrics.observe_verification(time.perf_counter() - started, accepted=True)
        return swarm_pb2.SubmitBundleResponse(
            bundle_id=record.bundle_id,
            verified_rewards=record.verified_rewards,
            reward_mismatches=record.reward_mismatches,
        )

    @in_band_errors(swarm_pb2.PullBundlesResponse)
    @authenticated("PullBundles")
    def PullBundles(self, request: swarm_pb2.PullBundlesRequest, context: Any,  # noqa: N802
                    node: NodeRecord) -> Any:
        page = relay.pull_bundles(self.ctx, node, request.cursor, request.max_bundles,
                                  request.tokenizer_fingerprint, request.skip_zero_variance)
        metrics.relayed(len(page.bundles))
        return convert.relay_page_bytes(page)

    @in_band_errors(swarm_pb2.ReportMetricsResponse)
    @authenticated("ReportMetrics")
    def ReportMetrics(self, request: swarm_pb2.ReportMetricsRequest, context: Any,  # noqa: N802
                      node: NodeRecord) -> Any:
        dropped = feedback.report_metrics(self.ctx, node, request.step, dict(request.values),
                                          list(request.feedback))
        return swarm_pb2.ReportMetricsResponse(dropped_feedback=[
            swarm_pb2.DroppedFeedback(index=d.index, sender_node_id=d.sender_id, error=(
                common_pb2.Error(code=ErrorCode.FEEDBACK_INVALID, reason=d.reason)))
            for d in dropped])

    @in_band_errors(swarm_pb2.UploadTokenizerResponse)
    @authenticated("UploadTokenizer")
    def UploadTokenizer(self, request: swarm_pb2.UploadTokenizerRequest,  # noqa: N802
                        context: Any, node: NodeRecord) -> Any:
        nodes.upload_tokenizer(self.ctx, node, request.fingerprint, request.tokenizer_json_gz)
        return swarm_pb2.UploadTokenizerResponse()


#: Methods that the ``"aio-inline"`` listener runs on its event loop: they only read and
#: write through the group commit and the worker pools, which yield to the loop while
#: they wait (:mod:`ftis.coordinator.waiting`). The others (registration, tokenizer
#: uploads, metrics reports with their feedback evidence) write in transactions of their
#: own, which would hold the loop for their lock and fsync; they run in the handler pool.
INLINE_METHODS = frozenset({"Heartbeat", "LeaseTasks", "SubmitBundle", "PullBundles"})

_METHODS: dict[str, tuple[type, type]] = {
    "Register": (swarm_pb2.RegisterRequest, swarm_pb2.RegisterResponse),
    "Heartbeat": (swarm_pb2.HeartbeatRequest, swarm_pb2.HeartbeatResponse),
    "LeaseTasks": (swarm_pb2.LeaseTasksRequest, swarm_pb2.LeaseTasksResponse),
    "SubmitBundle": (swarm_pb2.SubmitBundleRequest, swarm_pb2.SubmitBundleResponse),
    "PullBundles": (swarm_pb2.PullBundlesRequest, swarm_pb2.PullBundlesResponse),
    "ReportMetrics": (swarm_pb2.ReportMetricsRequest, swarm_pb2.ReportMetricsResponse),
    "UploadTokenizer": (swarm_pb2.UploadTokenizerRequest, swarm_pb2.UploadTokenizerResponse),
}


def _over_budget_response(response_cls: type, budget: ConnectionBudget) -> Any:
    return response_cls(error=common_pb2.Error(
        code=ErrorCode.RATE_LIMITED,
        reason=f"this connection's (or its host's) requests were refused more than "
               f"{budget.refusals.rate:g} times per second; slow down"))


def _too_many_response(response_cls: type, budget: ConnectionBudget) -> Any:
    return response_cls(error=common_pb2.Error(
        code=ErrorCode.RATE_LIMITED,
        reason=f"more than {budget.max_handling} requests of this connection are being "
               "handled at once; send them one after another"))


def _decode(data: bytes, request_cls: type[Message], response_cls: type, method: str,
            limit: int) -> tuple[Message | None, Any]:
    """``(request, None)``, or ``(None, refusal)`` for more than ``limit`` bytes
    (REQUEST_TOO_LARGE) or bytes that do not decode as ``request_cls``
    (REQUEST_INVALID, answered in-band: gRPC's own answer, INTERNAL, logs a traceback
    per request, which a flood of garbage turned into the coordinator's main cost;
    ``make bench-attack``)."""
    if len(data) > limit:
        return None, response_cls(error=common_pb2.Error(
            code=ErrorCode.REQUEST_TOO_LARGE,
            reason=f"{method} request is {len(data)} bytes, limit {limit}"))
    try:
        return request_cls.FromString(data), None
    except DecodeError:
        return None, response_cls(error=common_pb2.Error(
            code=ErrorCode.REQUEST_INVALID,
            reason=f"{len(data)} bytes that do not decode as a {method} request"))


def _answered(response: Any, connection: str, method: str, started: float,
              budget: ConnectionBudget) -> Any:
    """Count ``response``'s refusal (if any) against ``connection`` and its metrics."""
    code = _response_code(response)
    budget.record_refusal(connection, code)
    metrics.observe_rpc(method, time.perf_counter() - started, code)
    return response


def _late_answer(response_cls: type, budget: ConnectionBudget, method: str,
                 started: float) -> Any:
    """The RATE_LIMITED answer to a request of a connection over its budget, counted in
    the RPC metrics."""
    response = _over_budget_response(response_cls, budget)
    metrics.observe_rpc(method, time.perf_counter() - started, ErrorCode.RATE_LIMITED)
    return response


def _refusing(behavior: Callable[[Any, Any], Any], request_cls: type[Message],
              response_cls: type, method: str, limit: int, budget: ConnectionBudget,
              handling: threading.Semaphore) -> Callable[[bytes, Any], Any]:
    """The handler the thread-pool server (``swarm_server = "threads"``) calls with the
    request's raw bytes. In order, before anything is decoded:

    1. the connection (or its host) is over its refusal budget → RATE_LIMITED, answered after the
       budget's delay (``time.sleep`` holds this worker thread, not the GIL; the budget's
       ``max_delayed``, the server's delay threads, bounds how many wait);
    2. more than ``limit`` bytes → REQUEST_TOO_LARGE;
    3. bytes that do not decode as ``request_cls`` → REQUEST_INVALID (:func:`_decode`);

    then ``behavior``. A connection with ``budget.max_handling`` requests past step 1
    already gets RATE_LIMITED at once for the next (counted as a refusal). Steps 2, 3
    and ``behavior`` run while holding ``handling`` (the
    handler threads: the server has more worker threads than that, the rest for the
    delays of step 1, so that waiting requests never take a handler's place). Every
    in-band refusal is counted against the connection."""

    def handle(data: bytes, context: Any) -> Any:
        started = time.perf_counter()
        connection = _connection(context)
        limited = budget.limited_key(connection)
        if limited is not None:
            delay_s = budget.start_delay(limited)
            try:
                time.sleep(delay_s)
            finally:
                budget.end_delay(limited, delay_s)
            return _late_answer(response_cls, budget, method, started)
        if not budget.start_handling(connection):
            return _answered(_too_many_response(response_cls, budget), connection, method,
                             started, budget)
        try:
            with handling:
                request, response = _decode(data, request_cls, response_cls, method, limit)
                if request is not None:
                    response = behavior(request, context)
        finally:
            budget.end_handling(connection)
        return _answered(response, connection, method, started, budget)

    return handle


class Caller:
    """What a handler run off the event loop sees of its call: ``peer()`` (the
    ``grpc.aio`` context itself belongs to the loop's thread)."""

    __slots__ = ("_peer",)

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        """The caller's connection, ``ipv4:HOST:PORT`` ("" for none)."""
        return self._peer


def _refusing_async(behavior: Callable[[Any, Any], Any], request_cls: type[Message],
                    response_cls: type, method: str, limit: int, budget: ConnectionBudget,
                    executor: Executor | None) -> Callable[[bytes, Any], Awaitable[Any]]:
    """The coroutine the ``grpc.aio`` server calls with the request's raw bytes: the
    checks of :func:`_refusing`, in the event loop and before any thread hop, except
    that a connection over budget waits in ``asyncio.sleep`` (no thread held, no cap on
    how many wait) for :meth:`ConnectionBudget.start_delay`, which grows with that
    connection's requests already waiting. Only a decoded request reaches ``behavior``
    (synchronous, database I/O), with a :class:`Caller`: in ``executor``, or with
    ``executor=None`` on the loop itself in a greenlet (SQLAlchemy's ``greenlet_spawn``),
    which yields to the loop while it waits for the group commit or a worker process
    (:mod:`ftis.coordinator.waiting`)."""

    async def handle(data: bytes, context: Any) -> Any:
        started = time.perf_counter()
        connection = _connection(context)
        limited = budget.limited_key(connection)
        if limited is not None:
            delay_s = budget.start_delay(limited)
            try:
                await asyncio.sleep(delay_s)
            finally:
                budget.end_delay(limited, delay_s)
            return _late_answer(response_cls, budget, method, started)
        if not budget.start_handling(connection):
            return _answered(_too_many_response(response_cls, budget), connection, method,
                             started, budget)
        try:
            request, response = _decode(data, request_cls, response_cls, method, limit)
            if request is not None and executor is None:
                response = await greenlet_spawn(behavior, request, Caller(connection))
            elif request is not None:
                loop = asyncio.get_running_loop()
                response = await loop.run_in_executor(executor, behavior, request,
                                                      Caller(connection))
        finally:
            budget.end_handling(connection)
        return _answered(response, connection, method, started, budget)

    return handle


def _response_code(response: Any) -> int:
    """The in-band error code of a response (0 for none; relay pages written as bytes
    carry none: an error is always a message)."""
    if isinstance(response, bytes | bytearray):
        return 0
    try:
        return int(response.error.code)
    except AttributeError:
        return 0


def _serialize(response: Any) -> bytes:
    """Messages are serialized; bytes (a relay page written by ``convert``) go as they are."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_swarm_service(servicer: SwarmService, server: grpc.Server | grpc.aio.Server,
                      limits: dict[str, int], budget: ConnectionBudget,
                      executor: Executor | None = None, handler_threads: int = 32,
                      inline: frozenset[str] = frozenset()) -> None:
    """Register ``servicer`` on ``server``: each method gets the request's raw bytes,
    which are checked against the connection's refusal ``budget`` and the method's size
    limit (``limits``, bytes) before decoding. Same wire contract as the generated
    ``add_SwarmServicer_to_server``.

    Args:
        executor: for a ``grpc.aio`` server, the bounded pool the (synchronous) handlers
            run in (:func:`_refusing_async`); unused by a thread-pool ``grpc.server``,
            whose handlers run in its worker threads (:func:`_refusing`).
        inline: ``grpc.aio`` server only: methods whose handlers run on its event loop
            instead (:data:`INLINE_METHODS` for ``swarm_server = "aio-inline"``).
        handler_threads: thread-pool server only: how many of its worker threads may
            decode and handle requests at once (the others only wait out refusal delays).
    """
    handling = threading.BoundedSemaphore(handler_threads)
    on_loop = isinstance(server, grpc.aio.Server)
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method, (request_cls, response_cls) in _METHODS.items():
        behavior = getattr(servicer, method)
        handle: Callable[[bytes, Any], Any] = (
            _refusing_async(behavior, request_cls, response_cls, method, limits[method],
                            budget, None if method in inline else executor)
            if on_loop else
            _refusing(behavior, request_cls, response_cls, method, limits[method], budget,
                      handling))
        handlers[method] = grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=_serialize)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("ftis.v1.Swarm", handlers),)
    )
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers("ftis.v1.Swarm", handlers)
