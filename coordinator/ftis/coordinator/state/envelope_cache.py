"""Envelopes of recently relayed bundles, kept in memory by each serving process.

A stored bundle's envelope (its serialized ``SignedEnvelope``, about 20 KiB for G = 8
completions of 256 tokens) never changes, and every volunteer pulls the same recent
bundles: at N volunteers each one is relayed up to N - 1 times. On PostgreSQL every
page's envelopes otherwise cross the server's socket each time, so
:meth:`SqlState.pull_bundles` selects the page without envelopes and takes them from
here, reading from the database only the ones this process has not relayed yet (the
default there). On SQLite the row's pages come from the local file anyway, and the second
statement for each new bundle cost more than the copy it saved, so it has no cache by
default (paired runs in docs/benchmarks.md, "Re-scoring workers served from the event
loop, and what did not help").

Correctness needs only that a bundle's sequence number names one envelope forever:
sequences are never reused (``AUTOINCREMENT`` on SQLite, a sequence on PostgreSQL) and
bundles are never updated in place, so an entry can be stale only for a bundle that no
longer exists, which the page query does not return.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

#: Default bound of one process's cache: about 1,600 bundles of 20 KiB.
ENVELOPE_CACHE_BYTES = 32 * 1024 * 1024


class EnvelopeCache:
    """A least-recently-used map of bundle sequence -> envelope bytes, bounded by the sum
    of the envelopes' lengths. Safe to use from several threads.

    Args:
        max_bytes: the bound in bytes; 0 keeps nothing (every lookup misses). An envelope
            longer than ``max_bytes`` is not kept.

    Raises:
        ValueError: ``max_bytes < 0``.
    """

    def __init__(self, max_bytes: int = ENVELOPE_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes {max_bytes} < 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        #: lookups answered from memory / from the database, since the start
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        """The sum of the kept envelopes' lengths (bytes)."""
        return self._bytes

    def take(self, sequences: list[int]) -> tuple[dict[int, bytes], list[int]]:
        """The kept envelopes of ``sequences`` (each marked as just used) and the
        sequences not kept, in the order given."""
        found: dict[int, bytes] = {}
        missing: list[int] = []
        with self._lock:
            for seq in sequences:
                envelope = self._entries.get(seq)
                if envelope is None:
                    missing.append(seq)
                else:
                    self._entries.move_to_end(seq)
                    found[seq] = envelope
            self.hits += len(found)
            self.misses += len(missing)
        return found, missing

    def put(self, sequence: int, envelope: bytes) -> None:
        """Keep ``envelope`` as bundle ``sequence``'s, dropping the least recently used
        entries beyond :attr:`max_bytes`."""
        size = len(envelope)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(sequence, None)
            if old is not None:
                self._bytes -= len(old)
            self._entries[sequence] = envelope
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped)


__all__ = ["ENVELOPE_CACHE_BYTES", "EnvelopeCache"]
