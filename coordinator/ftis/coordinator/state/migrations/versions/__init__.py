"""Alembic revision modules (loaded by alembic from this directory, not imported)."""
