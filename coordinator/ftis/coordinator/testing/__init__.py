"""Test and benchmark support shipped with the coordinator (a throw-away PostgreSQL
server: :mod:`ftis.coordinator.testing.postgres`)."""
