"""In-memory quotas: token buckets per node / per peer host, with an injectable clock.

A bucket holds at most ``capacity`` tokens and refills continuously at
``capacity / period_s`` tokens per second, so "N per minute" allows a burst of N and a
sustained rate of N per minute. Quotas are per coordinator process and start full after
a restart (they bound load, they are not accounting).

Limits (all in :class:`~ftis.coordinator.config.CoordinatorConfig`):

* SubmitBundle: ``bundles_per_minute`` and ``bundle_bytes_per_minute`` per node,
  checked right after the envelope signature verified and the sender is known, before
  the lease/structure/tokenizer/re-scoring checks → RATE_LIMITED;
* PullBundles: ``pulls_per_minute`` per node → RATE_LIMITED;
* ReportMetrics: ``reports_per_minute`` per node → RATE_LIMITED (each report may write
  up to 64 evidence rows);
* UploadTokenizer: ``tokenizer_uploads_per_minute`` per node → RATE_LIMITED;
* Register of a NEW node id: ``registrations_per_minute`` globally and
  ``registrations_per_host_per_minute`` per peer host (IPv6 peers grouped by /64)
  → REGISTRATION_THROTTLED. Re-registration of a known node is never throttled.
* Verdict rows of refusals nobody can be charged for (an envelope whose signature does
  not verify): :data:`UNATTRIBUTED_VERDICTS_PER_S` per process; beyond it the refusal is
  answered as usual but only counted, not written (threat model §5, item 6).
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

Seconds = Callable[[], float]

#: Buckets kept per limiter before idle (full) ones are dropped.
MAX_BUCKETS = 100_000
#: Verdict rows per second a process writes for refusals nobody can be charged for.
UNATTRIBUTED_VERDICTS_PER_S = 20.0


@dataclass
class _Bucket:
    tokens: float
    at_s: float


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


class Quotas:
    """The per-process quotas of the coordinator (bundle quotas are counted in the
    database instead, so that they hold across worker processes: ``verify.check_quota``).

    Args:
        pulls_per_minute, tokenizer_uploads_per_minute, reports_per_minute: per-node
            limits.
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
        clock: Seconds = time.monotonic,
    ) -> None:
        self.pulls = RateLimiter(pulls_per_minute, clock=clock)
        self.tokenizer_uploads = RateLimiter(tokenizer_uploads_per_minute, clock=clock)
        self.registrations = RateLimiter(registrations_per_minute, clock=clock)
        self.registrations_per_host = RateLimiter(registrations_per_host_per_minute, clock=clock)
        self.reports = RateLimiter(reports_per_minute, clock=clock)
        self.unattributed_verdicts = RateLimiter(UNATTRIBUTED_VERDICTS_PER_S, period_s=1.0,
                                                 clock=clock)
        #: refusals answered without a verdict row (the budget above was spent)
        self.unattributed_dropped = 0

    def admit_pull(self, node_id: str) -> bool:
        return self.pulls.try_take(node_id)

    def admit_report(self, node_id: str) -> bool:
        return self.reports.try_take(node_id)

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
