"""Group commit (``state/group_commit.py``) on a real SQLite file: concurrent units share
transactions, each caller gets its own result or exception only after the COMMIT, one
unit's failure rolls back that unit alone, and a failed COMMIT fails the whole batch."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, text

from ftis.coordinator.state.group_commit import (
    GroupCommit,
    dbapi_savepoint,
    sqlalchemy_savepoint,
)


@pytest.fixture(params=["sqlalchemy", "dbapi"])
def savepoint(request: pytest.FixtureRequest) -> Any:
    """Both savepoint implementations (the SQL state uses ``dbapi_savepoint``)."""
    return sqlalchemy_savepoint if request.param == "sqlalchemy" else dbapi_savepoint


def _engine(path: Path) -> Engine:
    engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's pysqlite SAVEPOINT recipe

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (k INTEGER PRIMARY KEY)"))
    return engine


def _keys(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(text("SELECT k FROM t ORDER BY k"))]


def _insert(k: int) -> Callable[[Connection], int]:
    def work(conn: Connection) -> int:
        conn.execute(text("INSERT INTO t (k) VALUES (:k)"), {"k": k})
        return k * 10
    return work


def _slow_group(engine: Engine, savepoint: Any, commit_s: float
                ) -> tuple[GroupCommit, list[int]]:
    """A group commit whose every COMMIT takes ``commit_s`` (as long as an fsync), and the
    list that gets one entry per commit."""
    commits: list[int] = []

    @contextlib.contextmanager
    def slow_transaction() -> Iterator[Connection]:
        with engine.begin() as conn:
            yield conn
            time.sleep(commit_s)
        commits.append(1)

    return GroupCommit(slow_transaction, savepoint, threading.RLock()), commits


def test_concurrent_units_share_commits_and_each_gets_its_result(
        tmp_path: Path, savepoint: Any) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    group, commits = _slow_group(engine, savepoint, 0.01)
    results: dict[int, int] = {}

    def run(k: int) -> None:
        results[k] = group.run(_insert(k))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: k * 10 for k in range(32)}
    assert _keys(engine) == list(range(32))
    assert group.units == 32 and group.batches == len(commits)
    assert group.batches < 32  # units queued behind a busy leader shared its next commit


def test_a_failing_unit_rolls_back_alone(
        tmp_path: Path, savepoint: Any) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    group = GroupCommit(engine.begin, savepoint, threading.RLock())
    group.run(_insert(1))

    def duplicate_then_fail(conn: Connection) -> None:
        conn.execute(text("INSERT INTO t (k) VALUES (7)"))
        conn.execute(text("INSERT INTO t (k) VALUES (1)"))  # primary key taken

    # queue three units, then lead them as one batch
    outcomes: list[object] = []
    units = [_insert(5), duplicate_then_fail, _insert(6)]
    with group._lock:  # noqa: SLF001 - hold the lock so that all three queue up
        threads = [threading.Thread(target=lambda w=w: outcomes.append(_outcome(group, w)))
                   for w in units]
        for t in threads:
            t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert sorted(map(str, outcomes)) == ["50", "60", "IntegrityError"]
    assert _keys(engine) == [1, 5, 6]  # 7 was rolled back with its unit only
    assert group.batches == 2  # the first unit, then the three together


def _outcome(group: GroupCommit, work: Callable[[Connection], object]) -> object:
    try:
        return group.run(work)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__


def _failing_group(engine: Engine, savepoint: Any) -> GroupCommit:
    """A group commit whose every COMMIT fails (the disk is full)."""

    @contextlib.contextmanager
    def failing_commit() -> Iterator[Connection]:
        with engine.begin() as conn:
            yield conn
            raise OSError("disk full")

    return GroupCommit(failing_commit, savepoint, threading.RLock())


def test_a_failed_commit_fails_every_unit_of_its_batch(
        tmp_path: Path, savepoint: Any) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    group = _failing_group(engine, savepoint)
    with pytest.raises(OSError, match="disk full"):
        group.run(_insert(3))
    assert _keys(engine) == []  # nothing acknowledged, nothing stored
    with pytest.raises(ValueError):
        GroupCommit(engine.begin, sqlalchemy_savepoint, threading.RLock(), max_batch=0)


def test_units_from_handlers_on_the_event_loop_go_to_the_leader_thread(
        tmp_path: Path) -> None:
    """Inline on the event loop (``swarm_server = "aio-inline"``): ``run`` from greenlets
    returns each unit's result once committed, the units of handlers waiting together
    share commits, they run in the leader thread (not the loop's), a failing unit raises
    in its own handler only, and the loop keeps running other coroutines meanwhile."""
    import asyncio

    from sqlalchemy.util import greenlet_spawn

    engine = _engine(tmp_path / "db.sqlite")
    group, commits = _slow_group(engine, dbapi_savepoint, 0.02)
    ran_in: set[str] = set()

    def insert(k: int) -> Callable[[Connection], int]:
        def work(conn: Connection) -> int:
            ran_in.add(threading.current_thread().name)
            if k == 13:
                raise KeyError("unlucky")
            conn.execute(text("INSERT INTO t (k) VALUES (:k)"), {"k": k})
            return k * 10
        return work

    async def main() -> tuple[list[object], int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:  # the loop is free while the handlers wait
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        async def handler(k: int) -> object:
            try:
                return await greenlet_spawn(group.run, insert(k))
            except KeyError:
                return "KeyError"

        tick = asyncio.create_task(ticker())
        outcomes = await asyncio.gather(*(handler(k) for k in range(20)))
        stop.set()
        await tick
        return list(outcomes), ticks

    outcomes, ticks = asyncio.run(main())
    assert outcomes == [("KeyError" if k == 13 else k * 10) for k in range(20)]
    assert _keys(engine) == [k for k in range(20) if k != 13]
    assert ran_in == {"ftis-group-commit"}
    assert group.units == 20 and group.batches == len(commits) < 20
    assert ticks >= 10  # at least 20 ms of commits: the loop ran the ticker meanwhile


def test_a_failed_commit_reaches_every_waiting_handler(tmp_path: Path) -> None:
    import asyncio

    from sqlalchemy.util import greenlet_spawn

    engine = _engine(tmp_path / "db.sqlite")
    group = _failing_group(engine, dbapi_savepoint)

    async def main() -> list[object]:
        async def handler(k: int) -> object:
            try:
                return await greenlet_spawn(group.run, _insert(k))
            except OSError as exc:
                return str(exc)
        return list(await asyncio.gather(*(handler(k) for k in range(5))))

    assert asyncio.run(main()) == ["disk full"] * 5
    assert _keys(engine) == []
