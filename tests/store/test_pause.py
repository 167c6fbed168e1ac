"""Pause and resume in the job state machine, and a finished job's results file, on SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from store import jobs, progress, results
from store.models import File, Job, JobEvent
from store.objects import LocalObjectStore
from tests.store.conftest import make_job


def _statuses(s, job_id: str) -> list[str]:
    rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "status").order_by(JobEvent.id))
    return [e.data["status"] for e in rows]


def test_a_queued_job_pauses_at_once_is_not_taken_and_resumes_to_the_queue(db):
    job_id = make_job(db)
    with db.session() as s:
        job = s.get(Job, job_id)
        assert jobs.count_active(s, job.tenant_id) == 1
        jobs.request_pause(s, job)
        assert job.status == "paused" and job.finished_at is None
        assert jobs.request_pause(s, job).status == "paused", "pausing twice changes nothing"
        assert jobs.count_active(s, job.tenant_id) == 0, "a paused job does not count against the cap"
    with db.session() as s:
        assert jobs.claim(s, job_id, "w1", lease_seconds=60) is None, "no worker starts a paused job"
        assert jobs.claim_queued(s, job_id, "w1", lease_seconds=60) is None
    with db.session() as s:
        assert jobs.request_resume(s, s.get(Job, job_id), max_active=1) is True
    with db.session() as s:
        assert jobs.claim(s, job_id, "w1", lease_seconds=60).status == "running"
        assert _statuses(s, job_id) == ["paused", "queued", "running"]


def test_a_running_job_is_pausing_while_its_worker_holds_it_then_paused(db):
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
    with db.session() as s:
        jobs.request_pause(s, s.get(Job, job_id))
    with db.session() as s:
        job = s.get(Job, job_id)
        assert job.status == "pausing" and job.worker_id == "w1"
        jobs.hold(s, job_id, "w1")  # the worker still writes its last step and checkpoint
        assert jobs.heartbeat(s, job_id, "w1", 60)
        assert jobs.count_active(s, job.tenant_id) == 1, "a pausing job still holds its worker"
        jobs.transition(s, job, "paused")  # what the worker settles once it stopped
        assert job.worker_id is None and job.lease_until is None
    with db.session() as s, pytest.raises(jobs.LeaseLost):
        jobs.hold(s, job_id, "w1")


def test_resume_while_pausing_runs_on_and_cancel_works_on_paused_and_pausing(db):
    job_id, other = make_job(db), make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
        jobs.request_pause(s, s.get(Job, job_id))
        assert jobs.request_resume(s, s.get(Job, job_id)) is False
        assert s.get(Job, job_id).status == "running"
        jobs.request_pause(s, s.get(Job, job_id))
        assert jobs.request_cancel(s, s.get(Job, job_id)).status == "cancelling"
        jobs.request_pause(s, s.get(Job, other))
        cancelled = jobs.request_cancel(s, s.get(Job, other))
        assert cancelled.status == "cancelled" and cancelled.finished_at is not None


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_a_finished_job_neither_pauses_nor_resumes(db, status):
    job_id = make_job(db)
    with db.session() as s:
        job = s.get(Job, job_id)
        if status != "cancelled":
            jobs.transition(s, job, "running")
        jobs.transition(s, job, status)
        with pytest.raises(jobs.IllegalTransition):
            jobs.request_pause(s, job)
        with pytest.raises(jobs.IllegalTransition):
            jobs.request_resume(s, job)


def test_resume_is_refused_at_the_tenants_cap(db):
    job_id = make_job(db)
    with db.session() as s:
        job = s.get(Job, job_id)
        jobs.request_pause(s, job)
        jobs.create_job(
            s,
            tenant_id=job.tenant_id,
            model="toy",
            training_file_id=job.training_file_id,
            reward={"type": "regex"},
            hyperparameters={"steps": 1},
            total_steps=1,
            max_active=1,
        )
    with db.session() as s, pytest.raises(jobs.TooManyActiveJobs):
        jobs.request_resume(s, s.get(Job, job_id), max_active=1)


def test_the_reaper_pauses_a_pausing_job_whose_worker_died(db):
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
        jobs.request_pause(s, s.get(Job, job_id))
        s.get(Job, job_id).lease_until = jobs._now().replace(year=2000)
    with db.session() as s:
        assert jobs.reap(s) == ([], [])
        assert s.get(Job, job_id).status == "paused"


def test_a_finished_jobs_results_file_is_made_once(db, tmp_path):
    objects = LocalObjectStore(tmp_path)
    job_id = make_job(db)
    with db.session() as s:
        job = jobs.claim(s, job_id, "w1", lease_seconds=60)
        assert results.attach(s, objects, job) is None, "not before the job ended"
        progress.record_step(s, job_id, 1, {"reward/mean": 0.25, "loss": 1.5, "step": 1.0})
        progress.record_step(s, job_id, 2, {"reward/mean": 0.5, "loss": 1.0, "eval/reward/mean": 0.75})
        jobs.transition(s, job, "succeeded")
        assert results.jobs_without_results(s) == [job_id], "the reaper's sweep would write it"
        made = results.attach(s, objects, job)
    with db.session() as s:
        again = results.attach(s, objects, s.get(Job, job_id))
        assert again is not None and made is not None and again.id == made.id
        assert results.result_file_ids(s, job_id) == [made.id] and results.jobs_without_results(s) == []
        f = s.get(File, made.id)
        assert (f.purpose, f.tenant_id, f.rows, f.filename) == (
            "fine-tune-results",
            job.tenant_id,
            2,
            "step_metrics.csv",
        )
        rows = list(csv.DictReader(io.StringIO(objects.get_bytes(f.object_key).decode())))
        assert f.bytes == len(objects.get_bytes(f.object_key))
    assert list(rows[0]) == [
        "step",
        "train_mean_reward",
        "full_valid_mean_reward",
        "eval/reward/mean",
        "loss",
        "reward/mean",
    ]
    assert [(r["step"], r["train_mean_reward"], r["full_valid_mean_reward"]) for r in rows] == [
        ("1", "0.25", ""),
        ("2", "0.5", "0.75"),
    ]
    with db.session() as s:
        with pytest.raises(IntegrityError):  # the database refuses a second one too
            s.add(File(tenant_id=f.tenant_id, filename="x", bytes=0, rows=0, object_key="k", job_id=job_id))
            s.flush()
        s.rollback()
