"""A token bucket that caps the upload rate of bundles (``max_upload_rate``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """Caps a byte rate: ``rate`` bytes/s on average, bursts up to ``burst`` bytes.

    A send of ``n`` bytes waits until the bucket holds ``n`` (counting what refills
    while earlier sends wait), so by any time ``T`` at most ``burst + rate x T`` bytes
    have left, whatever the message sizes, a message larger than ``burst`` included.
    The bucket starts full. Thread-safe.

    Args:
        rate: bytes per second, > 0.
        burst: bucket size in bytes (default one second of ``rate``), > 0.
        clock: monotonic seconds (injectable for tests).

    Raises:
        ValueError: ``rate`` or ``burst`` not positive.
    """

    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or (burst is not None and burst <= 0):
            raise ValueError(f"rate and burst must be positive, got {rate}, {burst}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else rate)
        self.clock = clock
        self.tokens = self.burst
        self.stamp = clock()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` from the bucket; returns the seconds to wait before sending
        them (0 when the bucket held enough). Does not sleep."""
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            wait = max(0.0, (nbytes - self.tokens) / self.rate)
            self.tokens -= nbytes  # may go negative: the wait (or the next one) refills it
            return wait

    def consume(self, nbytes: int, sleep: Callable[[float], None] = time.sleep) -> float:
        """:meth:`reserve` then sleep the returned seconds; returns them."""
        wait = self.reserve(nbytes)
        if wait > 0:
            sleep(wait)
        return wait
