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


def test_0002_backfills_each_jobs_latest_metrics(tmp_path):
    from alembic import command
    from sqlalchemy import text

    from store.db import alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    make_engine(url).dispose()
    command.upgrade(alembic_config(url), "0001")
    engine = make_engine(url)
    now = "2026-11-22 00:00:00"
    with engine.begin() as c:
        c.execute(text(f"INSERT INTO tenants VALUES ('tn1', 't', '{now}')"))
        c.execute(
            text(
                "INSERT INTO files (id, tenant_id, filename, bytes, rows, object_key, item_fields, created_at) "
                f"VALUES ('f1', 'tn1', 'a.jsonl', 1, 1, 'files/a', '[]', '{now}')"
            )
        )
        for job in ("j1", "j2"):
            c.execute(
                text(
                    "INSERT INTO jobs (id, tenant_id, model, training_file_id, reward, hyperparameters, metadata, "
                    "seed, status, step, total_steps, created_at, attempts, max_attempts) VALUES "
                    f"('{job}', 'tn1', 'm', 'f1', '{{}}', '{{}}', '{{}}', 0, 'running', 2, 5, '{now}', 1, 3)"
                )
            )
        for step in (2, 1):  # inserted out of order: the newest step wins, not the last row
            c.execute(
                text(
                    "INSERT INTO step_metrics (job_id, step, metrics, created_at) VALUES "
                    f"('j1', {step}, '{{\"loss\": {step}.5}}', '{now}')"
                )
            )
    engine.dispose()
    run_migrations(url)
    engine = make_engine(url)
    with engine.connect() as c:
        got = dict(c.execute(text("SELECT id, latest_metrics FROM jobs")).all())
    engine.dispose()
    assert got == {"j1": '{"loss": 2.5}', "j2": None}
    assert _diff(url) == []


def test_0004_keeps_every_row_and_lets_files_go(tmp_path):
    """The SQLite table copy must not cascade-delete a job's events, metrics or checkpoints; after
    it, deleting a file nulls the jobs' reference instead of failing."""
    from alembic import command
    from sqlalchemy import text

    from store.db import alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    make_engine(url).dispose()
    command.upgrade(alembic_config(url), "0002")
    engine = make_engine(url)
    now = "2026-11-22 00:00:00"
    with engine.begin() as c:
        c.execute(text(f"INSERT INTO tenants VALUES ('tn1', 't', '{now}')"))
        c.execute(
            text(
                "INSERT INTO files (id, tenant_id, filename, bytes, rows, object_key, item_fields, created_at) "
                f"VALUES ('f1', 'tn1', 'a.jsonl', 1, 1, 'files/a', '[]', '{now}')"
            )
        )
        c.execute(
            text(
                "INSERT INTO jobs (id, tenant_id, model, training_file_id, validation_file_id, reward, "
                "hyperparameters, metadata, seed, status, step, total_steps, created_at, attempts, max_attempts) "
                f"VALUES ('j1', 'tn1', 'm', 'f1', 'f1', '{{}}', '{{}}', '{{}}', 0, 'succeeded', 2, 5, '{now}', 1, 3)"
            )
        )
        c.execute(
            text(f"INSERT INTO job_events (job_id, kind, message, created_at) VALUES ('j1', 'log', 'x', '{now}')")
        )
        c.execute(
            text(f"INSERT INTO step_metrics (job_id, step, metrics, created_at) VALUES ('j1', 1, '{{}}', '{now}')")
        )
        c.execute(
            text(
                "INSERT INTO checkpoints (id, job_id, tenant_id, step, object_prefix, size_bytes, metrics, final, "
                f"created_at) VALUES ('c1', 'j1', 'tn1', 1, 'jobs/j1/c', 1, '{{}}', 1, '{now}')"
            )
        )
    engine.dispose()
    run_migrations(url)
    assert _diff(url) == []
    engine = make_engine(url)  # foreign keys on, as the service runs
    with engine.begin() as c:
        counts = [
            c.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in ("job_events", "step_metrics", "checkpoints")
        ]
        assert counts == [1, 1, 1]
        c.execute(text("DELETE FROM files WHERE id = 'f1'"))
        assert c.execute(text("SELECT training_file_id, validation_file_id FROM jobs")).one() == (None, None)
    engine.dispose()
