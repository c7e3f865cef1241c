"""Alembic migrations of the coordinator database (run by :mod:`ftis.coordinator.state.migrate`).

``versions/`` holds one module per revision; ``env.py`` is alembic's entry point;
``schema_v1`` is the frozen schema of revision 0001 (the tables as the coordinator
created them with ``create_all`` before migrations existed).
"""
