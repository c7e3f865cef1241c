"""The SQLite write lock (``state/write_lock.py``): reentrant in a thread, exclusive
across threads, and exclusive across processes through the lock file, with the waiter
woken when the holder lets go (not after a busy handler's sleep)."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from pathlib import Path

import pytest

from ftis.coordinator.state.sql import SqlState
from ftis.coordinator.state.write_lock import WriteLock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

HOLD_S = 0.4


def _hold(path: str, held: multiprocessing.synchronize.Event, hold_s: float) -> None:
    lock = WriteLock(path)
    with lock:
        held.set()
        time.sleep(hold_s)
    lock.close()


def test_reentrant_within_a_thread(tmp_path: Path) -> None:
    lock = WriteLock(str(tmp_path / "db-ftis-write.lock"))
    with lock, lock, lock:
        pass
    other = WriteLock(str(tmp_path / "db-ftis-write.lock"))
    acquired = threading.Event()

    def take() -> None:
        with other:
            acquired.set()

    t = threading.Thread(target=take)
    t.start()
    t.join(5)
    assert acquired.is_set()  # the nested holds were all given back
    lock.close()
    other.close()


def test_threads_exclude_each_other(tmp_path: Path) -> None:
    lock = WriteLock(None)  # the thread lock alone (an in-memory database)
    assert not lock.across_processes
    inside, worst = [0], [0]

    def work() -> None:
        for _ in range(200):
            with lock:
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert worst[0] == 1


def test_another_process_waits_until_the_holder_lets_go(tmp_path: Path) -> None:
    path = str(tmp_path / "db-ftis-write.lock")
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    child = ctx.Process(target=_hold, args=(path, held, HOLD_S))
    child.start()
    try:
        assert held.wait(60), "the child never took the lock"
        lock = WriteLock(path)
        assert lock.across_processes
        t0 = time.monotonic()
        with lock:
            waited = time.monotonic() - t0
        lock.close()
    finally:
        child.join(30)
    # blocked while the child held it (at most HOLD_S since it took the lock), and woken
    # promptly once it let go: SQLite's busy handler would sleep up to 100 ms per try
    assert 0.5 * HOLD_S <= waited <= HOLD_S + 0.25


def test_a_file_database_locks_across_processes(tmp_path: Path) -> None:
    db = tmp_path / "ftis.db"
    state = SqlState(f"sqlite:///{db}")
    try:
        assert isinstance(state._sqlite_lock, WriteLock)
        assert state._sqlite_lock.across_processes
        assert Path(f"{db}-ftis-write.lock").exists()
    finally:
        state.close()
    memory = SqlState("sqlite://")
    try:
        assert memory._sqlite_lock is not None and not memory._sqlite_lock.across_processes
    finally:
        memory.close()
