"""Give the C heap's free memory back to the operating system between rounds.

A client runs for days. glibc's ``malloc`` keeps memory that Python and torch freed in
its arenas for reuse, and gives the top of a heap back only when it is free (``M_TRIM_
THRESHOLD``); a round whose tensors have other sizes than the last one's leaves free
chunks below live ones, and the resident set size then grows in steps that never come
back, although nothing is leaked. The hour-long soak (docs/benchmarks.md, "A node that
runs for days") saw the RSS floor step up by 23 MiB once, then stay. ``malloc_trim(0)``
releases every whole free page of every arena (``madvise(MADV_DONTNEED)``); it costs a
walk over the heap, milliseconds for a client's.

Only glibc has ``malloc_trim``; elsewhere (macOS, Windows, musl) :func:`trim_heap` does
nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def trim_heap() -> bool | None:
    """``malloc_trim(0)``: return the free pages of every glibc arena to the system.

    Returns:
        True if memory was released, False if there was none to release, None where the
        C library has no ``malloc_trim`` (nothing was done).
    """
    trim = _malloc_trim()
    if trim is None:
        return None
    return bool(trim(0))
