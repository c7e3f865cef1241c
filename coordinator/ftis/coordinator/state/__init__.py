"""Persistent coordinator state: abstract interface and the SQLAlchemy implementation."""
