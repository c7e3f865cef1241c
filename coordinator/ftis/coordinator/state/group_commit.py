"""Group commit: several writers' units of work share one transaction and one fsync.

SQLite has one writer at a time and, with ``synchronous=FULL``, every commit waits for
an fsync (about 3.5 ms on the benchmark machine), so the submit and lease paths were
bound at about 140 loops per second by fsyncs alone (docs/benchmarks.md). Here a writer
queues its unit of work and then takes the write lock; whoever holds the lock (the
*leader*) runs every queued unit, each in its own SAVEPOINT, and commits once. Each
caller gets its own result or its own exception, and only after the COMMIT returned:
nothing is acknowledged before it is durable, and one unit's failure (an integrity
error, a coded rejection) rolls back that unit alone. If the COMMIT itself fails, every
unit of the batch gets that error (nothing of it was stored).

This is the classic leader/follower group commit (as in PostgreSQL's ``commit_delay``
and InnoDB's binlog group commit), without any added wait: a batch holds exactly the
units that queued while the previous leader was busy. A caller in a thread of its own
leads itself. A handler inline on the event loop (:mod:`ftis.coordinator.waiting`) must
not block the loop for the lock and the fsync: its unit goes to a leader thread that
this object starts on first need (:meth:`GroupCommit.submit`), and the handler waits
for the unit's future.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ftis.coordinator import waiting

T = TypeVar("T")

#: Most units in one transaction (bounds the work lost to a failed COMMIT and the time
#: the lock is held).
MAX_BATCH = 64


@dataclass
class _Unit(Generic[T]):
    work: Callable[[Any], T]
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    #: set once the unit is done, for a caller that does not lead (:meth:`submit`)
    future: Future[T] | None = None


class GroupCommit:
    """Run units of work in shared transactions (see the module docstring).

    Args:
        transaction: opens a write transaction and yields its connection; leaving the
            context commits (or rolls back on an exception). One call per batch.
        savepoint: opens a savepoint on that connection (a context manager that
            releases it, or rolls back to it on an exception).
        lock: the write lock; a unit runs only while it is held.
        max_batch: most units per transaction.
    """

    def __init__(
        self,
        transaction: Callable[[], contextlib.AbstractContextManager[Any]],
        savepoint: Callable[[Any], contextlib.AbstractContextManager[Any]],
        lock: contextlib.AbstractContextManager[Any],
        max_batch: int = MAX_BATCH,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._transaction = transaction
        self._savepoint = savepoint
        self._lock = lock
        self.max_batch = max_batch
        self._queue: deque[_Unit[Any]] = deque()
        self._queue_lock = threading.Lock()
        #: batches committed and units run (for benchmarks and tests)
        self.batches = 0
        self.units = 0
        self._leader: threading.Thread | None = None
        self._pending = threading.Event()

    def run(self, work: Callable[[Any], T]) -> T:
        """Run ``work(connection)`` inside a savepoint of a shared write transaction and
        return its result once that transaction has committed.

        Inline on the event loop (:func:`ftis.coordinator.waiting.inline`) the unit goes
        to the leader thread (:meth:`submit`) and the loop serves other requests while it
        waits.

        Raises:
            whatever ``work`` raised (its savepoint rolled back, other units unaffected),
            or the COMMIT's exception (nothing of the batch stored).
        """
        if waiting.inline():
            return waiting.wait_future(self.submit(work))
        unit: _Unit[T] = _Unit(work)
        with self._queue_lock:
            self._queue.append(unit)
        while True:
            with self._lock:
                if not unit.done:
                    self._lead()
            if unit.done:
                break
        if unit.error is not None:
            raise unit.error
        return unit.result

    def submit(self, work: Callable[[Any], T]) -> Future[T]:
        """Queue ``work`` for the leader thread; the future gets its result (or its
        exception, or the COMMIT's) once its transaction has committed."""
        future: Future[T] = Future()
        unit: _Unit[T] = _Unit(work, future=future)
        with self._queue_lock:
            self._queue.append(unit)
            if self._leader is None:
                self._leader = threading.Thread(target=self._leader_loop, daemon=True,
                                                name="ftis-group-commit")
                self._leader.start()
        self._pending.set()
        return future

    def _leader_loop(self) -> None:
        """The leader thread: lead whenever units are queued (a daemon; it holds nothing
        between batches)."""
        while True:
            self._pending.wait()
            self._pending.clear()
            while self._queue:
                with self._lock:
                    self._lead()

    def _lead(self) -> None:
        """As leader (lock held): run up to ``max_batch`` queued units and commit once."""
        with self._queue_lock:
            batch = [self._queue.popleft()
                     for _ in range(min(len(self._queue), self.max_batch))]
        if not batch:
            return
        try:
            with self._transaction() as conn:
                for unit in batch:
                    try:
                        with self._savepoint(conn):
                            unit.result = unit.work(conn)
                    except Exception as exc:  # noqa: BLE001 - handed to that caller
                        unit.error = exc
        except BaseException as exc:
            for unit in batch:  # the COMMIT failed: nothing of the batch was stored
                if unit.error is None:
                    unit.error, unit.result = exc, None
            if not isinstance(exc, Exception):
                raise
        finally:
            self.batches += 1
            self.units += len(batch)
            for unit in batch:
                unit.done = True
                if unit.future is not None:
                    if unit.error is not None:
                        unit.future.set_exception(unit.error)
                    else:
                        unit.future.set_result(unit.result)


@contextlib.contextmanager
def sqlalchemy_savepoint(conn: Any) -> Iterator[Any]:
    """A SAVEPOINT on a SQLAlchemy ``Connection`` (``begin_nested``): released when the
    block ends, rolled back to when it raises."""
    with conn.begin_nested():
        yield conn


@contextlib.contextmanager
def dbapi_savepoint(conn: Any) -> Iterator[Any]:
    """The same SAVEPOINT issued on the driver connection under a SQLAlchemy
    ``Connection`` (three short statements, without SQLAlchemy's nested-transaction
    objects, which cost more than the unit's own statements on the submit path). Only
    for a connection whose units never call ``begin_nested`` themselves."""
    raw = conn.connection.dbapi_connection
    cursor = raw.cursor()
    try:
        cursor.execute("SAVEPOINT ftis_unit")
        try:
            yield conn
        except BaseException:
            cursor.execute("ROLLBACK TO ftis_unit")
            cursor.execute("RELEASE ftis_unit")
            raise
        cursor.execute("RELEASE ftis_unit")
    finally:
        cursor.close()
