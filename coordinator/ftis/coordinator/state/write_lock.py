"""The SQLite write lock: one writer at a time across threads *and* processes.

SQLite has one writer per database file. Within a process, writers queue on a
``threading.RLock`` (and share commits, :mod:`.group_commit`). Across the processes of
``ftis-coordinator serve --workers N`` they would otherwise meet only at SQLite's own
lock, whose busy handler *sleeps and polls* (1, 2, 5, 10, ... up to 100 ms between tries,
``sqlite3_busy_timeout``): a writer that loses the race waits out a sleep even when the
lock was free again after a millisecond. An advisory ``flock`` on a file beside the
database queues them in the kernel instead, and the waiter wakes when the holder lets go.

On systems without ``fcntl`` (Windows, where ``--workers`` is not offered either) the
lock is the thread lock alone.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class WriteLock:
    """Reentrant across the threads of a process; exclusive across processes that open
    the same ``path`` (an advisory ``flock``, taken on the outermost acquire only).

    Args:
        path: the lock file (created if missing, never written); ``None``: the thread
            lock alone (an in-memory database has no other process).

    Raises:
        OSError: if ``path`` cannot be opened.
    """

    def __init__(self, path: str | None) -> None:
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        if path is not None and fcntl is not None:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    @property
    def across_processes(self) -> bool:
        """Whether other processes are excluded too (a lock file is held open)."""
        return self._fd is not None

    def acquire(self) -> None:
        self._thread_lock.acquire()
        self._depth += 1
        if self._depth == 1 and self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._depth -= 1
                self._thread_lock.release()
                raise

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def __enter__(self) -> WriteLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def close(self) -> None:
        """Close the lock file (the lock must not be held)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
