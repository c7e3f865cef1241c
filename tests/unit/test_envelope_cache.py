"""EnvelopeCache: least-recently-used, bounded by bytes (expected contents by hand)."""

from __future__ import annotations

import pytest

from ftis.coordinator.state.envelope_cache import EnvelopeCache


def test_take_returns_kept_envelopes_and_the_missing_sequences_in_order() -> None:
    cache = EnvelopeCache(max_bytes=100)
    cache.put(1, b"a" * 10)
    cache.put(3, b"c" * 30)
    found, missing = cache.take([4, 3, 2, 1])
    assert found == {3: b"c" * 30, 1: b"a" * 10} and missing == [4, 2]
    assert (cache.hits, cache.misses, cache.size_bytes, len(cache)) == (2, 2, 40, 2)


def test_least_recently_used_entries_go_first_when_over_the_bound() -> None:
    cache = EnvelopeCache(max_bytes=100)
    for seq in (1, 2, 3):
        cache.put(seq, bytes(40 - seq))      # 39 + 38 + 37 = 114 > 100: 1 goes
    assert cache.take([1, 2, 3])[1] == [1] and cache.size_bytes == 75
    cache.take([2])                          # 2 is now the most recently used
    cache.put(4, bytes(30))                  # 38 + 37 + 30 = 105: 3 goes, not 2
    found, missing = cache.take([2, 3, 4])
    assert sorted(found) == [2, 4] and missing == [3] and cache.size_bytes == 68


def test_replacing_an_entry_counts_its_bytes_once() -> None:
    cache = EnvelopeCache(max_bytes=100)
    cache.put(7, bytes(60))
    cache.put(7, bytes(50))
    assert (cache.size_bytes, len(cache)) == (50, 1)


def test_an_envelope_over_the_bound_and_a_zero_bound_keep_nothing() -> None:
    cache = EnvelopeCache(max_bytes=10)
    cache.put(1, bytes(11))
    assert cache.take([1]) == ({}, [1]) and cache.size_bytes == 0
    nothing = EnvelopeCache(max_bytes=0)
    nothing.put(1, b"x")
    assert nothing.take([1]) == ({}, [1])
    with pytest.raises(ValueError, match="< 0"):
        EnvelopeCache(max_bytes=-1)
