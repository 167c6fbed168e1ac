"""Alembic migrations: the only way the schema changes (SQLite and PostgreSQL)."""
