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


def test_concurrent_units_share_commits_and_each_gets_its_result(
        tmp_path: Path, savepoint: Any) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    commits = []

    @contextlib.contextmanager
    def slow_transaction() -> Iterator[Connection]:  # a commit as long as an fsync
        with engine.begin() as conn:
            yield conn
            time.sleep(0.01)
        commits.append(1)

    group = GroupCommit(slow_transaction, savepoint, threading.RLock())
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


def test_a_failed_commit_fails_every_unit_of_its_batch(
        tmp_path: Path, savepoint: Any) -> None:
    engine = _engine(tmp_path / "db.sqlite")

    @contextlib.contextmanager
    def failing_commit() -> Iterator[Connection]:
        with engine.begin() as conn:
            yield conn
            raise OSError("disk full")

    group = GroupCommit(failing_commit, savepoint, threading.RLock())
    with pytest.raises(OSError, match="disk full"):
        group.run(_insert(3))
    assert _keys(engine) == []  # nothing acknowledged, nothing stored
    with pytest.raises(ValueError):
        GroupCommit(engine.begin, sqlalchemy_savepoint, threading.RLock(), max_batch=0)
