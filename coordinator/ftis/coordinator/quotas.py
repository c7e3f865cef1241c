"""In-memory quotas: token buckets per node / per peer host, with an injectable clock.

A bucket holds at most ``capacity`` tokens and refills continuously at
``capacity / period_s`` tokens per second, so "N per minute" allows a burst of N and a
sustained rate of N per minute. Quotas are per coordinator process and start full after
a restart (they bound load, they are not accounting).

Limits (all in :class:`~ftis.coordinator.config.CoordinatorConfig`):

* SubmitBundle: ``bundles_per_minute`` and ``bundle_bytes_per_minute`` per node,
  checked right after the envelope signature verified and the sender is known, before
  the lease/structure/tokenizer/re-scoring checks → RATE_LIMITED;
* PullBundles: ``pulls_per_minute`` and ``pull_bytes_per_minute`` (envelope bytes of
  the relay pages served) per node → RATE_LIMITED; a page is cut to the bytes left;
* ReportMetrics: ``reports_per_minute`` per node → RATE_LIMITED (each report may write
  up to 64 evidence rows);
* UploadTokenizer: ``tokenizer_uploads_per_minute`` per node → RATE_LIMITED;
* Register of a NEW node id: ``registrations_per_minute`` globally and
  ``registrations_per_host_per_minute`` per peer host (IPv6 peers grouped by /64)
  → REGISTRATION_THROTTLED. Re-registration of a known node is never throttled.
* Heartbeat: ``heartbeats_per_minute`` per node → RATE_LIMITED (a signed Heartbeat
  costs a signature check; clients send one every ``heartbeat_interval_s``).
* Refusals per connection (:class:`ConnectionBudget`): a connection (one gRPC peer,
  ``ipv4:HOST:PORT``) whose refused requests exceed ``connection_refusals_per_s`` is
  answered RATE_LIMITED after a delay that grows with its requests already waiting,
  before its request is decoded (the servicer waits; this module only decides).
* Verdict rows of refusals nobody can be charged for (an envelope whose signature does
  not verify): :data:`UNATTRIBUTED_VERDICTS_PER_S` per process; beyond it the refusal is
  answered as usual but only counted, not written (threat model §5, item 6).
"""

from __future__ import annotations

import functools
import ipaddress
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftis.protocol.errors import ErrorCode

Seconds = Callable[[], float]

#: Buckets kept per limiter before idle (full) ones are dropped.
MAX_BUCKETS = 100_000
#: Verdict rows per second a process writes for refusals nobody can be charged for.
UNATTRIBUTED_VERDICTS_PER_S = 20.0
#: Refusals the coordinator causes itself, never counted against a connection.
UNCOUNTED_CODES = frozenset({ErrorCode.VERIFICATION_BUSY, ErrorCode.INTERNAL})


@dataclass
class _Bucket:
    tokens: float
    at_s: float


class ExpiringKeys:
    """Keys held until a time of the caller's clock (any unit, the same for every call):
    the refusal hold of a sender, a fingerprint known to be missing. Thread-safe; at
    ``capacity`` keys everything is forgotten (a memory, not a record: forgetting only
    costs the lookup it saved)."""

    def __init__(self, capacity: int = MAX_BUCKETS) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def hold(self, key: str, until: float) -> None:
        with self._lock:
            if len(self._until) >= self.capacity:
                self._until.clear()
            self._until[key] = until

    def release(self, key: str) -> None:
        with self._lock:
            self._until.pop(key, None)

    def held(self, key: str, now: float) -> bool:
        """Whether ``key`` is held at ``now`` (an expired key is dropped)."""
        with self._lock:
            until = self._until.get(key)
            if until is None:
                return False
            if now >= until:
                del self._until[key]
                return False
            return True


class RateLimiter:
    """Keyed token buckets: ``capacity`` tokens per ``period_s`` seconds per key.

    Thread-safe. ``clock`` returns seconds (monotonic in production).
    """

    def __init__(
        self, capacity: float, period_s: float = 60.0, clock: Seconds = time.monotonic
    ) -> None:
        if capacity <= 0 or period_s <= 0:
            raise ValueError("capacity and period_s must be > 0")
        self.capacity = float(capacity)
        self.rate = self.capacity / period_s
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def _refilled(self, key: str, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._prune(now)
            bucket = self._buckets[key] = _Bucket(self.capacity, now)
        else:
            elapsed = max(0.0, now - bucket.at_s)
            bucket.tokens = min(self.capacity, bucket.tokens + elapsed * self.rate)
            bucket.at_s = now
        return bucket

    def _prune(self, now: float) -> None:
        full_after = self.capacity / self.rate
        for key in [k for k, b in self._buckets.items() if now - b.at_s >= full_after]:
            del self._buckets[key]

    def available(self, key: str) -> float:
        """Tokens ``key`` could take now."""
        with self._lock:
            return self._refilled(key, self.clock()).tokens

    def try_take(self, key: str, amount: float = 1.0) -> bool:
        """Take ``amount`` tokens (clamped to the capacity) if available."""
        amount = min(float(amount), self.capacity)
        with self._lock:
            bucket = self._refilled(key, self.clock())
            if bucket.tokens + 1e-9 < amount:
                return False
            bucket.tokens -= amount
            return True


def try_take_all(takes: list[tuple[RateLimiter, str, float]]) -> bool:
    """Take from several buckets only if every one of them has enough (no partial takes
    when one is short). Not atomic across limiters, which is fine for throttling."""
    if not all(
        limiter.available(key) + 1e-9 >= min(amount, limiter.capacity)
        for limiter, key, amount in takes
    ):
        return False
    return all(limiter.try_take(key, amount) for limiter, key, amount in takes)


def peer_host(peer: str) -> str:
    """Host part of a gRPC ``context.peer()`` string, without the port.

    ``"ipv4:1.2.3.4:5678"`` -> ``"1.2.3.4"``; ``"ipv6:[2001:db8::1]:5678"`` ->
    ``"2001:db8::/64"`` (IPv6 hosts are grouped by /64, the usual end-site allocation);
    ``"unix:/path"`` -> ``"unix"``; anything else unparseable is returned unchanged.
    """
    if not peer:
        return ""
    scheme, _, rest = peer.partition(":")
    if scheme == "ipv4":
        return rest.rpartition(":")[0] or rest
    if scheme == "ipv6":
        host = rest.rpartition(":")[0] if rest.startswith("[") else rest
        host = host.strip("[]").split("%", 1)[0]
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            return host
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    if scheme.startswith("unix"):
        return "unix"
    return peer


#: Hosts no per-host refusal budget groups by default: this machine's own processes.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def host_in(host: str, networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
            ) -> bool:
    """Whether ``host`` (a :func:`peer_host` string: an address or an IPv6 /64) lies in
    one of ``networks``; hosts that are not addresses (``"unix"``) lie in none."""
    try:
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        return False
    return any(net.version == n.version and net.subnet_of(n)  # type: ignore[arg-type]
               for n in networks)


@functools.lru_cache(maxsize=4096)
def budget_host(connection: str,
                exempt: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
                ) -> str | None:
    """The host (:func:`peer_host`) whose refusal budget ``connection`` shares, or
    ``None`` for hosts in ``exempt`` and connections without one (memoised: parsing an
    IPv6 peer costs more than the bucket lookup it keys)."""
    host = peer_host(connection)
    return None if not host or host_in(host, exempt) else host


class Quotas:
    """The per-process quotas of the coordinator (bundle quotas are counted in the
    database instead, so that they hold across worker processes: ``verify.check_quota``).

    Args:
        pulls_per_minute, tokenizer_uploads_per_minute, reports_per_minute,
            heartbeats_per_minute: per-node limits.
        pull_bytes_per_minute: envelope bytes of relay pages per node and minute.
        registrations_per_minute, registrations_per_host_per_minute: new node ids.
        clock: seconds.
    """

    def __init__(
        self,
        *,
        pulls_per_minute: float,
        tokenizer_uploads_per_minute: float,
        registrations_per_minute: float,
        registrations_per_host_per_minute: float,
        reports_per_minute: float = 60.0,
        heartbeats_per_minute: float = 60.0,
        pull_bytes_per_minute: float = float(64 << 20),
        clock: Seconds = time.monotonic,
    ) -> None:
        self.pulls = RateLimiter(pulls_per_minute, clock=clock)
        self.pull_bytes = RateLimiter(pull_bytes_per_minute, clock=clock)
        self.tokenizer_uploads = RateLimiter(tokenizer_uploads_per_minute, clock=clock)
        self.registrations = RateLimiter(registrations_per_minute, clock=clock)
        self.registrations_per_host = RateLimiter(registrations_per_host_per_minute, clock=clock)
        self.reports = RateLimiter(reports_per_minute, clock=clock)
        self.heartbeats = RateLimiter(heartbeats_per_minute, clock=clock)
        self.unattributed_verdicts = RateLimiter(UNATTRIBUTED_VERDICTS_PER_S, period_s=1.0,
                                                 clock=clock)
        #: refusals answered without a verdict row (the budget above was spent)
        self.unattributed_dropped = 0
        self._pulling: set[str] = set()
        self._pulling_lock = threading.Lock()

    def admit_pull(self, node_id: str) -> bool:
        return self.pulls.try_take(node_id)

    def start_pull(self, node_id: str) -> bool:
        """Take ``node_id``'s one relay-page slot; ``False`` while another of its pulls is
        being served. A client pulls one page after another, so only a flood asks for a
        second at once, and its pages would be built side by side, holding the
        interpreter that serves every other node (docs/threat-model.md §4.16)."""
        with self._pulling_lock:
            if node_id in self._pulling:
                return False
            self._pulling.add(node_id)
            return True

    def end_pull(self, node_id: str) -> None:
        """Give back the slot :meth:`start_pull` took."""
        with self._pulling_lock:
            self._pulling.discard(node_id)

    def pull_bytes_left(self, node_id: str) -> int:
        """Envelope bytes of relay pages ``node_id`` may be served now (whole bytes)."""
        return int(self.pull_bytes.available(node_id))

    def charge_pull_bytes(self, node_id: str, size_bytes: int) -> None:
        """Count ``size_bytes`` served to ``node_id`` (at most what was left: a page's
        first bundle may exceed it, and the bucket never goes below empty)."""
        self.pull_bytes.try_take(node_id, min(float(size_bytes),
                                              self.pull_bytes.available(node_id)))

    def admit_report(self, node_id: str) -> bool:
        return self.reports.try_take(node_id)

    def admit_heartbeat(self, node_id: str) -> bool:
        return self.heartbeats.try_take(node_id)

    def admit_unattributed_verdict(self) -> bool:
        """Whether a refusal nobody can be charged for may write its verdict row."""
        if self.unattributed_verdicts.try_take(""):
            return True
        self.unattributed_dropped += 1
        return False

    def admit_tokenizer_upload(self, node_id: str) -> bool:
        return self.tokenizer_uploads.try_take(node_id)

    def admit_registration(self, host: str) -> bool:
        """A NEW node id registering from ``host`` (global and per-host buckets)."""
        return try_take_all(
            [(self.registrations, "", 1.0), (self.registrations_per_host, host, 1.0)]
        )


class ConnectionBudget:
    """Refused requests per connection, and how late a request of a connection over its
    budget is answered instead of served (issue 13, "Beyond these classes": an honest
    node's p99 within 2× while one connection misbehaves). Pure decision-making: no I/O,
    no sleeping (the servicer waits), an injectable clock.

    Every refusal costs the serving process CPU however cheap it is, and an attacker is
    limited only by its own speed: a connection that is refused over and over keeps one
    core busy (``make bench-attack``). Once a connection's refusals exceed
    ``refusals_per_s`` (after a burst of ``burst``), its requests are answered
    RATE_LIMITED after a delay, undecoded and unhandled, until the bucket refills;
    answers given late are not refusals of their own (so a connection that slows down
    is served again within ``1 / refusals_per_s`` seconds).

    The delay grows with the number ``w`` of that connection's requests waiting, this one
    included (:meth:`delay_for`)::

        delay = delay_s × max(1, w / waiting_per_delay)

    so a connection with ``k`` requests in flight, all waiting, gets ``k / delay`` =
    ``min(k / delay_s, waiting_per_delay / delay_s)`` answers per second over budget
    (64 with the defaults 0.25 s and 16), however large ``k``. Each costs a dict lookup
    and, in the event-loop server (``grpc.aio``), a sleeping coroutine: there,
    ``max_delayed`` is ``None`` and any number may wait. A server whose waiting requests
    hold worker threads sets ``max_delayed``: beyond that many waiting (all connections
    together) requests are answered at once, undecoded (threat model §5, item 12).

    **Per host.** A connection starts with a full bucket, so an attacker that reconnects
    after every ``burst`` refusals would escape the connection's budget. With
    ``host_refusals_per_s`` and ``host_burst`` set, the refusals of all connections of one
    host (:func:`peer_host`: an IPv4 address or an IPv6 /64) also share one bucket;
    while it is empty, every connection of that host is answered late, and the delay's
    waiting count is the host's (:meth:`limited_key`), so the host as a whole gets at
    most ``waiting_per_delay / delay_s`` late answers a second on the event-loop server.
    Volunteers behind one NAT address share that bucket: it is set several times the
    connection's. Hosts in ``host_exempt`` (default: loopback, this machine's own
    processes) have no host bucket.

    Honest nodes are refused rarely (a lease limit, a tokenizer upload asked for, a
    reward claim that differs); ``burst`` covers that. Codes the coordinator causes
    itself (VERIFICATION_BUSY, INTERNAL) are not counted (:data:`UNCOUNTED_CODES`).

    Args:
        refusals_per_s: sustained refusals per second a connection may cause.
        burst: refusals a connection may cause at once.
        delay_s: seconds a request of a connection over its budget waits while at most
            ``waiting_per_delay`` of that connection's requests wait.
        max_delayed: requests waiting at once, all connections together, or ``None``
            for no cap.
        waiting_per_delay: waiting requests of one connection per ``delay_s`` of delay.
        host_refusals_per_s, host_burst: the same for all connections of one host
            together, or ``None`` (both) for no per-host budget.
        host_exempt: networks (``"127.0.0.0/8"``) whose hosts have no host budget.
        max_handling: requests of one connection decoded or handled at once (more are
            refused at once, RATE_LIMITED, and counted as refusals: an honest client
            sends one request at a time), or ``None`` for no cap. Without it one
            connection with many requests in flight takes every handler thread, and its
            work (say, relay pages) queues the other nodes' requests behind it.
        clock: seconds.

    Raises:
        ValueError: non-positive ``refusals_per_s``, ``burst``, ``max_delayed``, ``max_handling``,
            ``waiting_per_delay``, ``host_refusals_per_s`` or ``host_burst``, only one of
            the last two given, a negative ``delay_s``, or a ``host_exempt`` entry that
            is not a network.
    """

    def __init__(self, *, refusals_per_s: float, burst: float, delay_s: float,
                 max_delayed: int | None = None, waiting_per_delay: int = 16,
                 host_refusals_per_s: float | None = None, host_burst: float | None = None,
                 host_exempt: tuple[str, ...] = LOOPBACK_NETWORKS,
                 max_handling: int | None = None,
                 clock: Seconds = time.monotonic) -> None:
        if (refusals_per_s <= 0 or burst <= 0 or waiting_per_delay <= 0 or delay_s < 0
                or (max_delayed is not None and max_delayed <= 0)
                or (max_handling is not None and max_handling <= 0)):
            raise ValueError("refusals_per_s, burst, max_delayed, max_handling and "
                             "waiting_per_delay must be > 0, delay_s >= 0")
        if (host_refusals_per_s is None) != (host_burst is None) or (
                host_refusals_per_s is not None and host_burst is not None
                and (host_refusals_per_s <= 0 or host_burst <= 0)):
            raise ValueError("host_refusals_per_s and host_burst: both > 0, or both None")
        self.refusals = RateLimiter(burst, period_s=burst / refusals_per_s, clock=clock)
        self.host_refusals = (
            None if host_refusals_per_s is None or host_burst is None
            else RateLimiter(host_burst, period_s=host_burst / host_refusals_per_s,
                             clock=clock))
        self.host_exempt = tuple(ipaddress.ip_network(n, strict=False) for n in host_exempt)
        self.delay_s = delay_s
        self.max_delayed = max_delayed
        self.waiting_per_delay = waiting_per_delay
        self.max_handling = max_handling
        self._lock = threading.Lock()
        self._delayed = 0
        self._waiting: dict[str, int] = {}
        self._handling: dict[str, int] = {}
        #: requests answered RATE_LIMITED for their connection's budget (late or not)
        self.answered_over_budget = 0

    @property
    def max_answers_per_s(self) -> float:
        """Most answers over budget per second one connection gets while all its requests
        wait (``waiting_per_delay / delay_s``; infinite for ``delay_s`` 0)."""
        return self.waiting_per_delay / self.delay_s if self.delay_s > 0 else float("inf")

    def _host(self, connection: str) -> str | None:
        """``connection``'s host when it has a host budget, else ``None``."""
        if self.host_refusals is None:
            return None
        return budget_host(connection, self.host_exempt)

    def limited_key(self, connection: str) -> str | None:
        """The key whose budget refuses ``connection``'s next request, or ``None`` when
        it is served: its host (:func:`peer_host`) when the host's bucket is empty, else
        the connection itself when its own bucket is. Pass the key to
        :meth:`start_delay` and :meth:`end_delay`."""
        host = self._host(connection)
        if host is not None and self.host_refusals is not None \
                and self.host_refusals.available(host) < 1.0:
            return host
        if self.refusals.available(connection) < 1.0:
            return connection
        return None

    def over_budget(self, connection: str) -> bool:
        """Whether ``connection``'s next request is refused for its (or its host's)
        budget."""
        return self.limited_key(connection) is not None

    def record_refusal(self, connection: str, code: int) -> None:
        """Count a refusal (in-band ``code`` ≠ 0) against ``connection`` and its host."""
        if code and code not in UNCOUNTED_CODES:
            self.refusals.try_take(connection)
            host = self._host(connection)
            if host is not None and self.host_refusals is not None:
                self.host_refusals.try_take(host)

    def start_handling(self, connection: str) -> bool:
        """Whether a request of ``connection`` may be decoded and handled now: ``False``
        when ``max_handling`` of its requests are being handled already (the caller then
        refuses it, RATE_LIMITED, which counts against the budget). Pair every ``True``
        with :meth:`end_handling`. No cap when ``max_handling`` is ``None``."""
        with self._lock:
            handling = self._handling.get(connection, 0)
            if self.max_handling is not None and handling >= self.max_handling:
                return False
            self._handling[connection] = handling + 1
            return True

    def end_handling(self, connection: str) -> None:
        """A request that :meth:`start_handling` admitted was answered."""
        with self._lock:
            left = self._handling.get(connection, 0) - 1
            if left > 0:
                self._handling[connection] = left
            else:
                self._handling.pop(connection, None)

    def handling(self, connection: str) -> int:
        """Requests of ``connection`` being decoded or handled now."""
        with self._lock:
            return self._handling.get(connection, 0)

    def delay_for(self, waiting: int) -> float:
        """Seconds a request waits when ``waiting`` requests of its connection (itself
        included) wait: ``delay_s × max(1, waiting / waiting_per_delay)``."""
        return self.delay_s * max(1.0, waiting / self.waiting_per_delay)

    def waiting(self, connection: str) -> int:
        """Requests of ``connection`` (or of a host, :meth:`limited_key`) waiting now
        (between :meth:`start_delay` and :meth:`end_delay`)."""
        with self._lock:
            return self._waiting.get(connection, 0)

    def start_delay(self, connection: str = "") -> float:
        """Seconds the caller should wait before answering a request of ``connection``
        over budget (:meth:`delay_for` of its waiting requests, this one included), or 0
        when ``max_delayed`` requests already wait. Pair every call with
        :meth:`end_delay` of the same connection and the value returned."""
        with self._lock:
            self.answered_over_budget += 1
            if self.delay_s <= 0 or (self.max_delayed is not None
                                     and self._delayed >= self.max_delayed):
                return 0.0
            self._delayed += 1
            waiting = self._waiting.get(connection, 0) + 1
            self._waiting[connection] = waiting
            return self.delay_for(waiting)

    def end_delay(self, connection: str = "", delayed_s: float = 0.0) -> None:
        """A request of ``connection`` that :meth:`start_delay` told to wait
        ``delayed_s`` seconds stopped waiting (answered or cancelled)."""
        if delayed_s <= 0:
            return
        with self._lock:
            self._delayed -= 1
            left = self._waiting.get(connection, 0) - 1
            if left > 0:
                self._waiting[connection] = left
            else:
                self._waiting.pop(connection, None)
