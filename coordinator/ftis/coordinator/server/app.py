"""The coordinator server: the ``Swarm`` and ``Admin`` gRPC services on two listeners,
and optionally the HTTP listener of ``/metrics`` and the status page
(:mod:`ftis.coordinator.observe.http`, ``http_listen``).

Programmatic use (e.g. in an integration test)::

    from ftis.coordinator.config import CoordinatorConfig
    from ftis.coordinator.server.app import CoordinatorServer

    server = CoordinatorServer(CoordinatorConfig(
        listen="127.0.0.1:0", admin_listen="127.0.0.1:0", db=str(tmp_path / "c.db")))
    server.start()
    channel = grpc.insecure_channel(server.address)   # "127.0.0.1:<port>"
    ...
    server.stop(grace=1.0)
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from ftis.coordinator import reputation
from ftis.coordinator.config import CoordinatorConfig, parse_host_port
from ftis.coordinator.handlers import admin as admin_handlers
from ftis.coordinator.handlers.context import SEEN_FLUSH_S, Clock, Context, wall_clock_ms
from ftis.coordinator.observe import metrics
from ftis.coordinator.observe.http import HttpBindError, StatusHttpServer
from ftis.coordinator.quotas import ConnectionBudget
from ftis.coordinator.server.admin_service import AdminService
from ftis.coordinator.server.event_loop import AioServerThread
from ftis.coordinator.server.swarm_service import (
    INLINE_METHODS,
    SwarmService,
    add_swarm_service,
)
from ftis.coordinator.state.base import State
from ftis.coordinator.state.sql import SqlState
from ftis.protocol.bundles import MAX_GRPC_MESSAGE_BYTES
from ftis.v1 import admin_pb2_grpc

#: Seconds start-up waits for the re-scoring workers to be ready.
RESCORING_START_WAIT_S = 120.0

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    # Never share a port with another process (gRPC enables SO_REUSEPORT by default).
    ("grpc.so_reuseport", 0),
]


def swarm_grpc_options(config: CoordinatorConfig) -> list[tuple[str, int]]:
    """Options of the volunteer listener: messages above ``grpc_max_receive_bytes`` are
    refused by gRPC itself (status RESOURCE_EXHAUSTED, never decoded); smaller ones are
    checked per method before decoding (REQUEST_TOO_LARGE, see ``add_swarm_service``)."""
    return [
        ("grpc.max_receive_message_length", config.grpc_max_receive_bytes),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


def connection_budget(config: CoordinatorConfig) -> ConnectionBudget:
    """The per-connection refusal budget of ``config``.

    With the event-loop server (``swarm_server = "aio-inline"``, the default, or
    ``"aio"``) a waiting request is a sleeping coroutine and any number may wait, each
    connection's delay growing with its requests already waiting (at most ``16 /
    connection_delay_s`` answers a second per connection). With the thread-pool server
    (``"threads"``) a waiting request holds a
    worker thread: the server has ``swarm_delay_threads`` threads beyond its
    ``swarm_handler_threads`` for them, so at most that many wait at once and waiting
    never takes a handler's thread; beyond that, requests over budget are answered at
    once (threat model §5, item 12).

    gRPC's own per-connection stream limit (``grpc.max_concurrent_streams``) is not set:
    with it, the synchronous server refused sequential requests of one connection with
    RST_STREAM (REFUSED_STREAM) once the limit's worth had been answered (grpcio 1.85,
    measured with 2 and 8), which honest clients would see as UNAVAILABLE."""
    return ConnectionBudget(
        refusals_per_s=config.connection_refusals_per_s,
        burst=config.connection_refusal_burst,
        delay_s=config.connection_delay_s,
        host_refusals_per_s=config.host_refusals_per_s,
        host_burst=config.host_refusal_burst,
        host_exempt=tuple(config.host_refusal_exempt),
        max_handling=config.connection_max_handling,
        max_delayed=(config.swarm_delay_threads if config.swarm_server == "threads"
                     else None))


class BindError(RuntimeError):
    """A listener address cannot be bound."""


def _bind(server: grpc.Server | AioServerThread, address: str) -> int:
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise BindError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise BindError(f"cannot listen on {address}")
    return port


class CoordinatorServer:
    """Hosts :class:`SwarmService` and :class:`AdminService` on separate gRPC servers:
    the volunteer service on a ``grpc.aio`` server in its own event-loop thread
    (:class:`AioServerThread`; or a thread-pool server with ``swarm_server =
    "threads"``), the admin service on a thread-pool server. The API is synchronous.

    Args:
        config: settings; ``listen``/``admin_listen`` may use port 0 (any free port).
        state: storage; by default an :class:`SqlState` on ``config.db_url``.
        clock: unix-milliseconds clock.
        reuse_port: bind with SO_REUSEPORT (one of several worker processes on the same
            ports, :mod:`ftis.coordinator.server.workers`).
        http_listen: ``HOST:PORT`` of the HTTP listener (``/metrics``, status page), or
            ``None`` for none (the default; ``serve`` turns it on).
        http_optional: if the HTTP address cannot be bound, log a warning and serve
            without it instead of failing (``serve`` with its default address).

    Whatever the listeners, the server counts its metrics
    (:mod:`ftis.coordinator.observe.metrics`): the servicer's RPCs and the database's
    transactions.

    Raises:
        DatabaseError: if the database cannot be opened (raised by the constructor).
        ValueError: the reputation policy in force turns on audit-based probation with
            no bootstrap (:func:`~ftis.coordinator.handlers.admin.audit_bootstrap_problem`;
            raised by the constructor).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        state: State | None = None,
        clock: Clock = wall_clock_ms,
        reuse_port: bool = False,
        http_listen: str | None = None,
        http_optional: bool = False,
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.state = (state if state is not None
                      else SqlState(config.db_url, task_block=config.task_number_block))
        engine = getattr(self.state, "engine", None)  # an SqlState's
        if engine is not None:
            metrics.instrument_engine(engine)
        self.ctx = Context.create(config, self.state, clock)
        for seed in config.audit_seed_nodes:  # seeds registered before this start
            self.state.set_audit_status(seed, reputation.AUDIT_PASSED)
        problem = admin_handlers.audit_bootstrap_problem(self.ctx, self.ctx.policy)
        if problem is not None:
            if state is None:
                self.state.close()
            raise ValueError(problem)
        self.http_listen = http_listen
        self.http_optional = http_optional
        self._http: StatusHttpServer | None = None
        self._stopping = threading.Event()
        self._flusher: threading.Thread | None = None
        self._swarm: grpc.Server | AioServerThread | None = None
        self._handlers: ThreadPoolExecutor | None = None
        self._admin: grpc.Server | None = None
        self._port = 0
        self._admin_port = 0

    def start(self) -> None:
        """Load the spot-check models (if any), bind both listeners and start serving.

        Raises:
            SpotCheckLoadError: a spot-check model did not load (nothing is bound).
            BindError: if an address cannot be bound (nothing is left running); the HTTP
                address only when not ``http_optional``.
        """
        if self.ctx.spot_checks is not None:
            self.ctx.spot_checks.start()  # blocks until every worker holds the models
        swarm = self._swarm_server()
        admin = grpc.server(
            ThreadPoolExecutor(4, thread_name_prefix="ftis-admin"),
            options=self._options(GRPC_OPTIONS),
        )
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(self.ctx), admin)
        try:
            self._port = _bind(swarm, self.config.listen)
            self._admin_port = _bind(admin, self.config.admin_listen)
        except BindError:
            swarm.stop(None)
            admin.stop(None)
            raise
        if self.http_listen:
            http = StatusHttpServer(self.http_listen, self.state, self.ctx.clock,
                                    self.config.reputation)
            try:
                http.start()
                self._http = http
            except HttpBindError as exc:
                if not self.http_optional:
                    swarm.stop(None)
                    admin.stop(None)
                    raise BindError(str(exc)) from None
                log.warning("%s; serving without the status page and /metrics", exc)
        # serve only once the re-scoring workers have imported the scorer: a first
        # bundle must not wait out their start-up
        self.ctx.rescoring.start(wait_s=RESCORING_START_WAIT_S)
        swarm.start()
        admin.start()
        self._swarm, self._admin = swarm, admin
        self._stopping.clear()
        self._flusher = threading.Thread(target=self._flush_loop, name="ftis-flush", daemon=True)
        self._flusher.start()
        log.info("swarm service on %s, admin service on %s", self.address, self.admin_address)
        self._log_probation()

    def _log_probation(self) -> None:
        """Say at start how probation ends; warn when a listener other nodes can reach
        lets it end on the count of verified bundles alone (a node with no model that
        computes correct answers can then earn standing; docs/reputation.md)."""
        policy = self.ctx.policy
        if policy.audit_reporters > 0:
            log.info("probation: %d verified bundles and an audit by %d established "
                     "receivers (seeds: %d, held models: %d)", policy.probation_bundles,
                     policy.audit_reporters, len(self.config.audit_seed_nodes),
                     len(self.config.spot_checks.models))
            return
        host = parse_host_port(self.config.listen)[0].strip("[]")
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = host == "localhost"
        (log.info if local else log.warning)(
            "probation ends on %d verified bundles alone (reputation.audit_reporters = 0): "
            "correct answers are enough to earn standing; for a public swarm turn on "
            "audit-based probation with audit_seed_nodes or spot_checks.models "
            "(docs/reputation.md)", policy.probation_bundles)

    def _swarm_server(self) -> grpc.Server | AioServerThread:
        """The volunteer listener, not yet bound: a ``grpc.aio`` server on its own
        event-loop thread whose handlers run in a pool of ``swarm_handler_threads``
        (``swarm_server = "aio"``), or on the loop itself for the hot methods
        (``"aio-inline"``, :data:`INLINE_METHODS`), or a thread-pool ``grpc.server``
        (``"threads"``)."""
        servicer = SwarmService(self.ctx)
        limits = self.config.method_request_limits
        budget = connection_budget(self.config)
        options = self._options(swarm_grpc_options(self.config))
        if self.config.swarm_server == "threads":
            server = grpc.server(
                ThreadPoolExecutor(self.config.swarm_handler_threads
                                   + self.config.swarm_delay_threads,
                                   thread_name_prefix="ftis-swarm"),
                options=options)
            add_swarm_service(servicer, server, limits, budget,
                              handler_threads=self.config.swarm_handler_threads)
            return server
        handlers = ThreadPoolExecutor(self.config.swarm_handler_threads,
                                      thread_name_prefix="ftis-swarm")
        self._handlers = handlers
        inline = INLINE_METHODS if self.config.swarm_server == "aio-inline" else frozenset()
        return AioServerThread(
            options, lambda server: add_swarm_service(servicer, server, limits, budget,
                                                      handlers, inline=inline),
            name="ftis-swarm-loop")

    def _options(self, options: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """``options`` with SO_REUSEPORT on for a worker of ``serve --workers N``."""
        if not self.reuse_port:
            return options
        return [o for o in options if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", 1)]

    @property
    def port(self) -> int:
        """Bound port of the volunteer service (0 before :meth:`start`)."""
        return self._port

    @property
    def admin_port(self) -> int:
        """Bound port of the admin service (0 before :meth:`start`)."""
        return self._admin_port

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the HTTP listener as bound (``None`` when off)."""
        return self._http.address if self._http is not None else None

    @property
    def address(self) -> str:
        """``host:port`` of the volunteer service as bound."""
        return f"{parse_host_port(self.config.listen)[0]}:{self._port}"

    @property
    def admin_address(self) -> str:
        """``host:port`` of the admin service as bound."""
        return f"{parse_host_port(self.config.admin_listen)[0]}:{self._admin_port}"

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls, let running ones finish for ``grace`` seconds, close the
        database. Idempotent."""
        if self._http is not None:
            self._http.stop()
            self._http = None
        # the admin server's stop returns at once, the event-loop server's once it is done
        events = [s.stop(grace) for s in (self._admin, self._swarm) if s is not None]
        for event in events:
            event.wait()
        self._swarm = self._admin = None
        if self._handlers is not None:
            self._handlers.shutdown(wait=False, cancel_futures=True)
            self._handlers = None
        self._stopping.set()
        if self._flusher is not None:
            self._flusher.join()
            self._flusher = None
        try:
            self.ctx.seen.flush(self.state)
        except Exception:
            log.exception("flushing last-seen times failed")
        self.ctx.rescoring.close()
        if self.ctx.spot_checks is not None:
            self.ctx.spot_checks.close()
        self.state.close()
        metrics.mark_process_dead()  # a worker of serve --workers N: its live files go

    def _flush_loop(self) -> None:
        """Every :data:`SEEN_FLUSH_S`: write buffered last-seen times, and reload the
        reputation policy (another worker process may have changed it)."""
        while not self._stopping.wait(SEEN_FLUSH_S):
            try:
                self.ctx.seen.flush(self.state)
                self.ctx.policy = self.ctx.load_policy()
            except Exception:
                log.exception("periodic flush failed")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout`` seconds pass); True if stopped."""
        if self._swarm is None:
            return True
        timed_out = self._swarm.wait_for_termination(timeout)
        return not timed_out

    def __enter__(self) -> CoordinatorServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(1.0)
