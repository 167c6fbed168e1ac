"""Fencing of a worker's writes by its lease, on real PostgreSQL: a worker that lost its job writes nothing."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from store import jobs
from store.db import Database
from store.models import Checkpoint, Job, StepMetric
from store.objects import LocalObjectStore
from tests.conftest import truncate_all
from tests.store.conftest import make_job
from worker.persist import PersistCallbacks
from worker.runner import _fail, _settle


@pytest.fixture()
def db(pg_database):
    truncate_all(pg_database)
    database = Database(pg_database)
    yield database
    database.dispose()


def _callbacks(db, objects, job_id: str, worker_id: str, attempt: int) -> PersistCallbacks:
    return PersistCallbacks(db, objects, job_id, worker_id, attempt, threading.Event(), threading.Event())


def _checkpoint_dir(tmp_path, name: str):
    d = tmp_path / name / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d.parent


def test_a_worker_that_lost_its_job_writes_nothing_more(db, tmp_path):
    objects = LocalObjectStore(tmp_path / "objects")
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
    old = _callbacks(db, objects, job_id, "w1", 1)
    old.on_step(1, {"reward/mean": 0.1})
    with db.session() as s:  # w1 stalled past its lease (or lost the database); w2 took the job over
        s.get(Job, job_id).lease_until = jobs._now().replace(year=2000)
    with db.session() as s:
        assert jobs.claim(s, job_id, "w2", lease_seconds=60) is not None

    with pytest.raises(jobs.LeaseLost):
        old.on_step(2, {"reward/mean": 0.9})
    assert old.lease_lost.is_set() and old.stop_reason == "lease_lost"
    with pytest.raises(jobs.LeaseLost):
        old.on_checkpoint(2, str(_checkpoint_dir(tmp_path, "old")), final=False)
    assert old.should_stop()
    with pytest.raises(jobs.LeaseLost):
        _callbacks(db, objects, job_id, "w1", 1).should_stop()  # before its heartbeat noticed
    assert objects.list(f"jobs/{job_id}/") == [], "nothing uploaded by the worker that lost the job"
    assert _fail(db, job_id, "w1", "RuntimeError: boom") == "lease_lost"
    with pytest.raises(jobs.LeaseLost):
        _settle(db, job_id, "w1", _callbacks(db, objects, job_id, "w1", 1), settings=None)

    new = _callbacks(db, objects, job_id, "w2", 2)
    new.on_step(2, {"reward/mean": 0.2})
    new.on_checkpoint(2, str(_checkpoint_dir(tmp_path, "new")), final=False)
    with db.session() as s:
        job = s.get(Job, job_id)
        assert (job.status, job.worker_id, job.error, job.step) == ("running", "w2", None, 2)
        rows = s.execute(select(StepMetric.step, StepMetric.metrics).where(StepMetric.job_id == job_id)
                         .order_by(StepMetric.step)).all()
        assert [(r.step, r.metrics["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2)]
        ckpt = s.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id))
        assert ckpt.object_prefix == f"jobs/{job_id}/checkpoints/step-000002-a2"
    assert _settle(db, job_id, "w2", new, settings=None) == "succeeded"
