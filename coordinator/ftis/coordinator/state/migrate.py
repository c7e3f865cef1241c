"""Schema migrations: ``alembic upgrade head``, run programmatically when a
:class:`~ftis.coordinator.state.sql.SqlState` opens a database (no ``alembic.ini``).

Three cases, all in ONE transaction (on PostgreSQL under an advisory lock, so that
several worker processes opening the same database at once migrate it once; on SQLite
the write transaction is ``BEGIN IMMEDIATE``):

* a database at head: nothing is done (one ``SELECT`` of the version table);
* a database made before migrations (coordinator tables, no ``alembic_version``):
  brought to exactly revision 0001 (missing tables and columns added, rows kept),
  stamped at 0001, then upgraded;
* an empty or older database: upgraded to head.

Adding a revision: put a module in ``migrations/versions`` (copy the newest one; set
``revision`` and ``down_revision``) and update the ORM models in ``sql.py`` to match;
``tests/state/test_migrations.py`` checks that both give the same schema. To let alembic
draft one: ``python -c "from alembic import command; from ftis.coordinator.state.migrate
import alembic_config; command.revision(alembic_config(url='sqlite:///x.db'),
'message', autogenerate=True)"`` on a database at head.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, inspect, text

#: The directory with ``env.py`` and ``versions/``.
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
#: The revision that matches the schema of releases before migrations.
INITIAL_REVISION = "0001"
#: The newest revision (``tests/state/test_migrations.py`` checks it is alembic's head).
HEAD_REVISION = "0007"
#: ``pg_advisory_xact_lock`` key serialising migrations of one PostgreSQL database.
_PG_LOCK_KEY = 0x46544953  # "FTIS"


def alembic_config(connection: Connection | None = None, url: str | None = None) -> Config:
    """An alembic ``Config`` built in code: the packaged scripts, and either an open
    ``connection`` (used as is, inside its transaction) or a database ``url``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


def current_revision(connection: Connection) -> str | None:
    """The stamped revision, or ``None`` when the database has no version table."""
    if not inspect(connection).has_table("alembic_version"):
        return None
    return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to ``revision`` (see the module docstring)."""
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
        stamped = current_revision(connection)
        if revision == "head" and stamped == HEAD_REVISION:
            return
        config = alembic_config(connection)
        if stamped is None and inspect(connection).has_table("nodes"):
            from ftis.coordinator.state.migrations import schema_v1

            schema_v1.complete_legacy(connection)
            command.stamp(config, INITIAL_REVISION)
        command.upgrade(config, revision)
