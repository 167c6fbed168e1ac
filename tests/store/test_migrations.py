"""Alembic is the only way the schema changes: the migrations build exactly the models' schema."""

from __future__ import annotations

import os

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from store.db import make_engine, run_migrations
from store.models import Base


def _diff(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


def test_migrations_match_models_on_both_databases(db):
    assert _diff(db.url) == []
    names = set(inspect(db.engine).get_table_names())
    assert {t.name for t in Base.metadata.sorted_tables} | {"alembic_version"} <= names


def test_run_migrations_from_any_cwd_and_twice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("elsewhere")
    monkeypatch.chdir("elsewhere")
    url = f"sqlite:///{tmp_path / 'deep' / 'dir' / 'gspo.db'}"
    run_migrations(url)
    run_migrations(url)  # already at head: a no-op
    assert _diff(url) == []
