"""``node/heap.py``: freed C-heap memory goes back to the system between rounds."""

from __future__ import annotations

import ctypes
import sys

import psutil
import pytest

from ftis.client.node import heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_trim_returns_freed_heap_pages_to_the_system() -> None:
    """64 MiB in 4-KiB malloc chunks, freed all but the last: glibc keeps the freed
    chunks below the live one (the top cannot shrink past it), so the RSS stays up;
    after trim_heap() it drops by most of the 64 MiB."""
    if heap._malloc_trim() is None:
        pytest.skip("not glibc")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    proc = psutil.Process()
    heap.trim_heap()
    chunks = []
    for _ in range(16384):  # 16384 × 4 KiB = 64 MiB, below the mmap threshold each
        p = libc.malloc(4096)
        libc.memset(p, 1, 4096)
        chunks.append(p)
    for p in chunks[:-1]:
        libc.free(p)
    held = proc.memory_info().rss
    assert heap.trim_heap() is True
    released = held - proc.memory_info().rss
    libc.free(chunks[-1])
    assert released > 48 << 20, released / 2**20


def test_elsewhere_it_does_nothing(monkeypatch) -> None:
    heap._malloc_trim.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert heap.trim_heap() is None
    finally:
        heap._malloc_trim.cache_clear()
