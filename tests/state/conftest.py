"""Fixtures of the storage tests: a real PostgreSQL server (see
:mod:`ftis.coordinator.testing.postgres`; ``FTIS_SKIP_POSTGRES=1`` skips its half) and a
``state`` parametrised over SQLite (a file) and PostgreSQL (a database per test)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftis.coordinator.state.sql import SqlState
from ftis.coordinator.testing.postgres import PostgresServer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # state_records

BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(scope="session")
def postgres_template(request: pytest.FixtureRequest) -> str:
    """A database migrated to head once; per-test databases are copies of it."""
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = server.create_database()
    SqlState(server.url(name)).close()
    return name


def fresh_url(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> str:
    """URL of a new, migrated database on ``backend``."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    template = request.getfixturevalue("postgres_template")
    return server.url(server.create_database(template=template))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def state_url(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> str:
    return fresh_url(request, backend, tmp_path)


@pytest.fixture
def state(state_url: str) -> Iterator[SqlState]:
    opened = SqlState(state_url)
    try:
        yield opened
    finally:
        opened.close()
