"""Prometheus metrics of the coordinator (``prometheus-client``).

Counted where the servicer sees them (:mod:`ftis.coordinator.server.swarm_service`):

==========================================  ==============================================
``ftis_rpc_duration_seconds{method}``       histogram: every Swarm RPC, from the decoded
                                            request to the built response
``ftis_rpc_handled_total{method,code}``     responses by in-band code (``OK`` or the
                                            ``ErrorCode`` name)
``ftis_bundles_accepted_total``             SubmitBundle replies without an error
``ftis_bundles_rejected_total{code}``       SubmitBundle replies by rejecting code
``ftis_bundles_relayed_total``              bundles in the relay pages served (PullBundles)
``ftis_leases_issued_total``                leases handed out by LeaseTasks
``ftis_bundle_verification_seconds{outcome}``  histogram: the SubmitBundle *handler* call
                                            (envelope decoding, signature, every check,
                                            re-scoring, and its database read and commit;
                                            not the gRPC decode nor the reply)
``ftis_db_transaction_seconds{kind}``       histogram: database transactions (``read`` /
                                            ``write``), from BEGIN (a SQLite writer's lock
                                            wait included) to the connection's return to
                                            the pool (commit included)
==========================================  ==============================================

Read from the database at scrape time (:class:`SwarmCollector`, cached for
:data:`SCRAPE_CACHE_S`): ``ftis_nodes_registered``, ``ftis_nodes_active`` (seen within
5 minutes), ``ftis_nodes_quarantined``, ``ftis_nodes_banned``,
``ftis_leases_outstanding``, ``ftis_leases_expired_total`` (unanswered leases past their
deadline) and ``ftis_database_up``.

Several worker processes (``serve --workers N``) use prometheus-client's multiprocess
mode: the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` for its children, whose metrics
then live in per-process files there (each child marks itself dead on exit), and the
supervisor serves their sum (:func:`exposition_registry` with ``multiprocess_dir``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ftis.protocol.errors import code_name

log = logging.getLogger(__name__)

#: Environment variable of prometheus-client's multiprocess mode.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds the database-backed gauges are reused between scrapes.
SCRAPE_CACHE_S = 5.0
#: A node seen within this window counts as active (as in ``ftis-admin stats``).
ACTIVE_WINDOW_MS = 5 * 60 * 1000

# no ``*_created`` series: scrapers compute rates from the counters themselves
disable_created_metrics()

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)

RPC_SECONDS = Histogram(
    "ftis_rpc_duration_seconds", "Swarm RPC handling time (decoded request to response).",
    ["method"], buckets=_LATENCY_BUCKETS)
RPC_HANDLED = Counter(
    "ftis_rpc_handled", "Swarm RPC responses by in-band code (OK = no error).",
    ["method", "code"])
BUNDLES_ACCEPTED = Counter("ftis_bundles_accepted", "Bundles verified and stored.")
BUNDLES_REJECTED = Counter("ftis_bundles_rejected", "Bundles rejected, by error code.", ["code"])
BUNDLES_RELAYED = Counter("ftis_bundles_relayed", "Bundles sent in relay pages (PullBundles).")
LEASES_ISSUED = Counter("ftis_leases_issued", "Task leases issued (LeaseTasks).")
VERIFICATION_SECONDS = Histogram(
    "ftis_bundle_verification_seconds",
    "SubmitBundle handler time: decoding, signature, checks, re-scoring and its database "
    "read and commit (measured around the handler call), by outcome.",
    ["outcome"], buckets=_LATENCY_BUCKETS)
SPOT_CHECKS = Counter(
    "ftis_spot_checks", "Log-prob spot checks against held weights, by outcome (passed, "
    "failed, busy, skipped_card).", ["outcome"])
SPOT_CHECK_NATS = Histogram(
    "ftis_spot_check_mean_abs_nats",
    "Mean |claimed - recomputed| log-prob of spot-checked bundles, nats/token.",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0))
DB_SECONDS = Histogram(
    "ftis_db_transaction_seconds",
    "Database transaction time from BEGIN to the connection's return (commit included).",
    ["kind"], buckets=_LATENCY_BUCKETS)


def code_label(code: int) -> str:
    """``OK`` for 0, else the error code's name (``RATE_LIMITED``)."""
    return "OK" if not code else code_name(int(code))


def observe_rpc(method: str, seconds: float, code: int) -> None:
    """One Swarm RPC answered with in-band ``code`` after ``seconds``."""
    RPC_SECONDS.labels(method).observe(seconds)
    RPC_HANDLED.labels(method, code_label(code)).inc()
    if method == "SubmitBundle":
        if code:
            BUNDLES_REJECTED.labels(code_label(code)).inc()
        else:
            BUNDLES_ACCEPTED.inc()


def observe_verification(seconds: float, accepted: bool) -> None:
    """One SubmitBundle handler call."""
    VERIFICATION_SECONDS.labels("accepted" if accepted else "rejected").observe(seconds)


def spot_check(outcome: str, mean_abs_nats: float | None = None) -> None:
    """One drawn spot check's outcome (and its statistic when it ran)."""
    SPOT_CHECKS.labels(outcome).inc()
    if mean_abs_nats is not None:
        SPOT_CHECK_NATS.observe(mean_abs_nats)


def relayed(n: int) -> None:
    if n:
        BUNDLES_RELAYED.inc(n)


def leases_issued(n: int) -> None:
    if n:
        LEASES_ISSUED.inc(n)


# -- database transactions -----------------------------------------------------------
_TX_KEY = "ftis_tx_started"


def instrument_engine(engine: Any) -> bool:
    """Time every transaction of an SQLAlchemy ``engine`` (and of the engines derived
    from it with ``execution_options``, which share its events and pool) into
    ``ftis_db_transaction_seconds``. Transactions whose connection carries the
    ``ftis_write`` execution option (the state's write engine) are ``write``, others
    ``read``. Idempotent; returns False if ``engine`` was already instrumented."""
    from sqlalchemy import event

    if getattr(engine, "_ftis_instrumented", False):
        return False

    def begin(conn: Any) -> None:
        kind = "write" if conn.get_execution_options().get("ftis_write") else "read"
        conn.info[_TX_KEY] = (time.perf_counter(), kind)

    def checkin(_dbapi_connection: Any, record: Any) -> None:
        started = record.info.pop(_TX_KEY, None) if record.info else None
        if started is not None:
            DB_SECONDS.labels(started[1]).observe(time.perf_counter() - started[0])

    # insert=True: before the state's own BEGIN (IMMEDIATE) listener, so a SQLite
    # writer's wait for the file lock is part of its transaction time
    event.listen(engine, "begin", begin, insert=True)
    event.listen(engine.pool, "checkin", checkin)
    engine._ftis_instrumented = True
    return True


# -- database-backed gauges ------------------------------------------------------------
class SwarmCollector:
    """Node and lease gauges read from the database (:meth:`State.swarm_counts`) when
    scraped, reused for ``cache_s`` seconds (several scrapers cost one query)."""

    def __init__(self, state: Any, clock: Callable[[], int], cache_s: float | None = None,
                 active_window_ms: int = ACTIVE_WINDOW_MS) -> None:
        self.state = state
        self.clock = clock
        self.cache_s = SCRAPE_CACHE_S if cache_s is None else cache_s
        self.active_window_ms = active_window_ms
        self._lock = threading.Lock()
        self._cached: tuple[float, Any] | None = None

    def counts(self) -> Any:
        """The counts (cached); raises what the database raises."""
        with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.cache_s:
                return self._cached[1]
            counts = self.state.swarm_counts(self.clock(), self.active_window_ms)
            self._cached = (now, counts)
            return counts

    def describe(self) -> list[Metric]:
        return []  # never query the database at registration

    def collect(self) -> Iterator[Metric]:
        try:
            c = self.counts()
        except Exception:
            log.exception("reading the swarm counts for /metrics failed")
            yield GaugeMetricFamily("ftis_database_up",
                                    "1 if the last scrape could read the database.", value=0)
            return
        yield GaugeMetricFamily("ftis_database_up",
                                "1 if the last scrape could read the database.", value=1)
        for name, doc, value in (
            ("ftis_nodes_registered", "Registered nodes.", c.nodes),
            ("ftis_nodes_active", "Nodes seen within the last 5 minutes.", c.active_nodes),
            ("ftis_nodes_quarantined", "Quarantined nodes (bundles stored, not relayed; "
             "banned nodes excluded).", c.quarantined_nodes),
            ("ftis_nodes_banned", "Banned nodes.", c.banned_nodes),
            ("ftis_leases_outstanding", "Unanswered leases before their deadline.",
             c.leases_outstanding),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("ftis_leases_expired",
                                  "Leases never answered before their deadline.",
                                  value=c.leases_expired)


class _RegistryView:
    """A collector that yields another registry's metrics (this process's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when this process runs in multiprocess mode."""
    return os.environ.get(MULTIPROC_ENV) or None


def exposition_registry(state: Any, clock: Callable[[], int], *,
                        multiprocess_dir: str | None = None) -> CollectorRegistry:
    """What ``/metrics`` serves: this process's metrics (or, with ``multiprocess_dir``,
    the sum over the worker processes that write there) plus :class:`SwarmCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    if multiprocess_dir:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
    else:
        registry.register(_RegistryView(REGISTRY))
    registry.register(SwarmCollector(state, clock))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format."""
    return generate_latest(registry)


def mark_process_dead(pid: int | None = None) -> None:
    """Multiprocess mode: drop the live-gauge files of ``pid`` (default: this process),
    as prometheus-client asks of an exiting worker. Its counters and histograms stay
    (they keep counting in the sum). No-op outside multiprocess mode."""
    path = multiprocess_dir()
    if path is None:
        return
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(pid if pid is not None else os.getpid(), path)
    except OSError:
        log.exception("marking process %s dead for metrics failed", pid)
