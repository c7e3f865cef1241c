"""Alembic environment of the coordinator database.

Run programmatically by :func:`ftis.coordinator.state.migrate.upgrade`, which hands over
an open connection in ``config.attributes["connection"]`` (inside its transaction). With
no connection, ``sqlalchemy.url`` from the config is used (e.g. a developer's
``alembic -x`` session built with :func:`ftis.coordinator.state.migrate.alembic_config`).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from ftis.coordinator.state.sql import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _main() -> None:
    if context.is_offline_mode():
        context.configure(
            url=config.get_main_option("sqlalchemy.url"),
            target_metadata=target_metadata,
            literal_binds=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


_main()
