"""Store fixtures: a migrated database on SQLite and on real PostgreSQL (a fresh database per session)."""

from __future__ import annotations

import uuid

import pytest

from store.db import Database
from store.models import File, Job
from store.tenants import create_tenant_and_key
from tests.conftest import empty_database_url


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    database = Database(empty_database_url(request, tmp_path))
    yield database
    database.dispose()


def make_job(database: Database, *, steps: int = 10, max_attempts: int = 3) -> str:
    """A tenant, a file and a queued job; returns the job id."""
    with database.session() as s:
        tenant, _ = create_tenant_and_key(s, f"t-{uuid.uuid4().hex[:8]}")
        f = File(
            tenant_id=tenant.id, filename="t.jsonl", bytes=10, rows=1, object_key="files/x", item_fields=["prompt"]
        )
        s.add(f)
        s.flush()
        job = Job(
            tenant_id=tenant.id,
            model="toy",
            training_file_id=f.id,
            reward={"type": "regex"},
            hyperparameters={"steps": steps},
            total_steps=steps,
            max_attempts=max_attempts,
        )
        s.add(job)
        s.flush()
        return job.id
