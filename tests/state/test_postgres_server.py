"""The PostgreSQL test server (ftis.coordinator.testing.postgres) itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from ftis.coordinator.testing import postgres
from ftis.coordinator.testing.postgres import PostgresServer, PostgresUnavailable


def test_session_database_is_reachable(postgres_url: str, postgres_server: PostgresServer
                                       ) -> None:
    assert postgres_url.startswith("postgresql+psycopg://")
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_user")).scalar() == "postgres"
            assert conn.execute(text("SHOW listen_addresses")).scalar() == ""  # socket only
            assert conn.execute(text("SHOW server_encoding")).scalar() == "UTF8"
    finally:
        engine.dispose()
    pid = postgres_server.process.pid
    uid = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                   .splitlines() if line.startswith("Uid:")))
    assert uid != 0  # PostgreSQL refuses root; as root the server runs as another user
    if os.geteuid() != 0:
        assert uid == os.geteuid()


def test_each_call_makes_a_new_database(postgres_database) -> None:
    first, second = postgres_database(), postgres_database()
    assert first != second
    engines = [create_engine(u) for u in (first, second)]
    try:
        with engines[0].begin() as conn:
            conn.execute(text("CREATE TABLE t (x int)"))
        with engines[1].connect() as conn:
            assert conn.execute(text("SELECT to_regclass('t')")).scalar() is None
    finally:
        for e in engines:
            e.dispose()


def test_missing_binaries_are_reported(tmp_path: Path) -> None:
    with pytest.raises(PostgresUnavailable, match="no initdb"):
        PostgresServer(bindir=tmp_path).start()


def test_skip_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(postgres.SKIP_ENV, "1")
    assert postgres.skip_requested()
    monkeypatch.setenv(postgres.SKIP_ENV, "0")
    assert not postgres.skip_requested()
    monkeypatch.delenv(postgres.SKIP_ENV)
    assert not postgres.skip_requested()


def test_stop_leaves_the_directory_to_a_background_rm(tmp_path: Path) -> None:
    """A stopped server's directory is gone from its path at once, and removed soon
    after by a detached ``rm -rf`` (the session's teardown does not wait for it)."""
    import time

    server = PostgresServer()
    try:
        server.start()
    except PostgresUnavailable as exc:
        pytest.skip(f"no PostgreSQL server here: {exc}")
    root = server.root
    assert root is not None and (root / "data").is_dir()
    server.stop()
    assert server.root is None and not root.exists()
    trash = root.with_name(root.name + "-removing")
    deadline = time.monotonic() + 60
    while trash.exists():
        assert time.monotonic() < deadline, f"{trash} still there after 60 s"
        time.sleep(0.1)
