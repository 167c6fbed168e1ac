"""The job state machine, leases, idempotent progress writes and the reaper, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from store import jobs, progress
from store.models import Checkpoint, Job, JobEvent, Sample, StepMetric
from store.scheduling import TenantQueue, Waiting
from store.usage import QueuePolicy
from tests.store.conftest import make_job


def _status_events(s, job_id: str) -> list[str]:
    rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "status").order_by(JobEvent.id))
    return [e.data["status"] for e in rows]


def test_create_job_is_queued_with_an_event(db):
    job_id = make_job(db)
    with db.session() as s:
        tenant_id, file_id = s.get(Job, job_id).tenant_id, s.get(Job, job_id).training_file_id
        job = jobs.create_job(
            s,
            tenant_id=tenant_id,
            model="toy",
            training_file_id=file_id,
            reward={"type": "x"},
            hyperparameters={"steps": 3},
            total_steps=3,
            seed=7,
            max_attempts=2,
        )
        assert job.id.startswith("job_") and job.status == "queued" and job.attempts == 0
        assert _status_events(s, job.id) == ["queued"]


def test_legal_path_stamps_times_and_records_events(db):
    job_id = make_job(db)
    with db.session() as s:
        job = s.get(Job, job_id)
        jobs.transition(s, job, "running")
        assert job.started_at is not None and job.finished_at is None
        jobs.transition(s, job, "succeeded")
        assert job.finished_at is not None and job.worker_id is None
    with db.session() as s:
        assert _status_events(s, job_id) == ["running", "succeeded"]


@pytest.mark.parametrize(
    "path",
    [
        ["succeeded"],
        ["cancelled", "running"],
        ["running", "succeeded", "running"],
        ["running", "failed", "queued"],
        ["cancelling"],
    ],
)
def test_illegal_transitions_are_refused(db, path):
    job_id = make_job(db)
    with db.session() as s:
        job = s.get(Job, job_id)
        with pytest.raises(jobs.IllegalTransition):
            for to in path:
                jobs.transition(s, job, to)


def test_claim_is_exclusive_while_the_lease_lives_and_taken_over_when_stale(db):
    job_id = make_job(db)
    with db.session() as s:
        job = jobs.claim(s, job_id, "w1", lease_seconds=60)
        assert job.status == "running" and job.worker_id == "w1" and job.attempts == 1
    with db.session() as s:
        assert jobs.claim(s, job_id, "w2", lease_seconds=60) is None, "a duplicate delivery must not take a live lease"
        assert jobs.heartbeat(s, job_id, "w1", 60) and not jobs.heartbeat(s, job_id, "w2", 60)
        s.get(Job, job_id).lease_until = jobs._now().replace(year=2000)  # w1 died: its lease went stale
    with db.session() as s:
        job = jobs.claim(s, job_id, "w2", lease_seconds=60)
        assert job is not None and job.worker_id == "w2" and job.attempts == 2 and job.status == "running"
        assert not jobs.heartbeat(s, job_id, "w1", 60), "the old holder learns it lost the lease"


def test_concurrent_claims_have_exactly_one_winner(db):
    job_id = make_job(db)
    barrier, wins = threading.Barrier(6), []

    def contender(name: str) -> None:
        barrier.wait()
        with db.session() as s:
            if jobs.claim(s, job_id, name, lease_seconds=60) is not None:
                wins.append(name)

    threads = [threading.Thread(target=contender, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(wins) == 1
    with db.session() as s:
        assert s.get(Job, job_id).attempts == 1 and s.get(Job, job_id).worker_id == wins[0]


def _stale(s, job_id: str) -> None:
    s.get(Job, job_id).lease_until = jobs._now().replace(year=2000)


def test_writes_are_fenced_by_the_lease(db):
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
        jobs.hold(s, job_id, "w1")
        with pytest.raises(jobs.LeaseLost):
            jobs.hold(s, job_id, "w2")
    with db.session() as s:
        _stale(s, job_id)  # w1 stalled past its lease; its row still names it until someone takes over
    with db.session() as s:
        jobs.hold(s, job_id, "w1")
        assert jobs.claim(s, job_id, "w2", lease_seconds=60) is not None
    with db.session() as s:
        with pytest.raises(jobs.LeaseLost, match="w1 no longer holds"):
            jobs.hold(s, job_id, "w1")
        jobs.hold(s, job_id, "w2")
        jobs.transition(s, s.get(Job, job_id), "succeeded")
    with db.session() as s, pytest.raises(jobs.LeaseLost):
        jobs.hold(s, job_id, "w2")  # a settled job takes no more writes


def test_a_takeover_waits_for_the_holders_write_in_flight(db):
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=60)
        _stale(s, job_id)
    took_over = threading.Event()

    def successor() -> None:
        with db.session() as s:
            if jobs.claim(s, job_id, "w2", lease_seconds=60) is not None:
                took_over.set()

    with db.session() as s:
        jobs.hold(s, job_id, "w1")
        t = threading.Thread(target=successor)
        t.start()
        assert not took_over.wait(1.0), "the takeover must wait until the fenced write commits"
        progress.record_step(s, job_id, 1, {"step": 1})
    t.join(30)
    assert took_over.is_set()
    with db.session() as s:
        assert s.get(Job, job_id).worker_id == "w2" and s.get(Job, job_id).step == 1


def test_a_stale_lease_past_the_retry_budget_is_not_taken_over(db):
    job_id = make_job(db, max_attempts=2)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=-1)
        s.get(Job, job_id).attempts = 2
    with db.session() as s:
        assert jobs.claim(s, job_id, "w2", lease_seconds=60) is None, "the reaper fails it instead"
        assert jobs.reap(s)[1] == [job_id]


def test_finished_jobs_cannot_be_claimed(db):
    job_id = make_job(db)
    with db.session() as s:
        jobs.request_cancel(s, s.get(Job, job_id))
        assert s.get(Job, job_id).status == "cancelled"
    with db.session() as s:
        assert jobs.claim(s, job_id, "w1", 60) is None


def test_step_metrics_samples_and_checkpoints_are_idempotent_per_step(db):
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", 60)
        for step in (1, 2, 2, 1, 3):  # a resumed attempt rewrites steps it already reported
            progress.record_step(s, job_id, step, {"reward/mean": step / 10, "step": step})
            progress.record_samples(s, job_id, step, [{"prompt": "p", "completions": []}])
    with db.session() as s:
        rows = s.execute(
            select(StepMetric.step, StepMetric.metrics).where(StepMetric.job_id == job_id).order_by(StepMetric.step)
        ).all()
        assert [(r.step, r.metrics["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.3)]
        assert s.scalar(select(func.count()).select_from(Sample).where(Sample.job_id == job_id)) == 3
        job = s.get(Job, job_id)
        assert job.step == 3
        first = progress.record_checkpoint(s, job, 2, "jobs/x/step-000002", 100, final=False)
        again = progress.record_checkpoint(s, job, 2, "jobs/x/step-000002", 120, final=False)
        progress.record_checkpoint(s, job, 3, "jobs/x/step-000003", 130, final=True)
        assert first.id == again.id and again.size_bytes == 120 and again.metrics["reward/mean"] == 0.2
        assert first.id.startswith("ckpt_") and first.tenant_id == job.tenant_id
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.job_id == job_id)) == 2
        latest = progress.latest_checkpoint(s, job_id)
        assert latest.step == 3 and latest.final


def test_cancel_of_a_running_job_goes_through_cancelling(db):
    job_id = make_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", 60)
        job = jobs.request_cancel(s, s.get(Job, job_id))
        assert job.status == "cancelling"
        assert jobs.heartbeat(s, job_id, "w1", 60), "the worker keeps its lease until it has stopped"
        jobs.transition(s, job, "cancelled")
        assert jobs.request_cancel(s, job).status == "cancelled"


def test_reaper_requeues_stale_fails_exhausted_and_leaves_live_leases(db):
    stale, exhausted, live, cancelling = (make_job(db, max_attempts=3) for _ in range(4))
    with db.session() as s:
        for job_id in (stale, exhausted, live, cancelling):
            jobs.claim(s, job_id, "w", lease_seconds=600 if job_id == live else -1)
        s.get(Job, exhausted).attempts = 3
        jobs.request_cancel(s, s.get(Job, cancelling))
    with db.session() as s:
        requeued, failed = jobs.reap(s)
    assert requeued == [stale] and failed == [exhausted]
    with db.session() as s:
        assert s.get(Job, stale).status == "queued" and s.get(Job, stale).worker_id is None
        assert s.get(Job, exhausted).status == "failed" and "retry budget" in s.get(Job, exhausted).error
        assert s.get(Job, live).status == "running"
        assert s.get(Job, cancelling).status == "cancelled"
    with db.session() as s:
        assert jobs.reap(s) == ([], []), "a second pass finds nothing to do"


def test_a_lost_attempt_ends_its_lease_at_once_for_the_reaper(db):
    """A rank of the job died (worker/runner.py): its holder ends the lease and the next reap requeues the
    job, as for a lost worker; a worker that no longer holds the job cannot end its successor's lease."""
    job_id = make_job(db, max_attempts=3)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", lease_seconds=600)
    with db.session() as s, pytest.raises(jobs.LeaseLost):
        jobs.end_lease(s, job_id, "w0")
    with db.session() as s:
        assert jobs.reap(s) == ([], []), "the lease lives"
        jobs.end_lease(s, job_id, "w1")
    with db.session() as s:
        assert jobs.reap(s) == ([job_id], [])
        assert s.get(Job, job_id).status == "queued"


def test_queue_position_counts_only_the_tenants_own_jobs_and_active_count(db):
    first, second, other = make_job(db), make_job(db), make_job(db)  # `other`: another tenant's, queued first
    with db.session() as s:
        s.get(Job, other).created_at = jobs._now().replace(year=2000)
        a, b = s.get(Job, first), s.get(Job, second)
        b.tenant_id = a.tenant_id
    with db.session() as s:
        a, b = s.get(Job, first), s.get(Job, second)
        queue = TenantQueue(s, QueuePolicy(), a.tenant_id)
        assert [queue.waiting(a), queue.waiting(b)] == [
            Waiting(1, "waiting for a free worker"),
            Waiting(2, "queued: 1 of your jobs ahead"),
        ]
        assert jobs.count_active(s, a.tenant_id) == 2
        jobs.claim(s, first, "w", 60)
        queue = TenantQueue(s, QueuePolicy(), a.tenant_id)
        assert queue.waiting(s.get(Job, first)) is None and queue.waiting(b).position == 1
        jobs.transition(s, s.get(Job, first), "failed", error="boom")
        assert jobs.count_active(s, a.tenant_id) == 1


def test_queued_without_message_lists_only_old_waiting_jobs(db):
    old, _fresh, running = make_job(db), make_job(db), make_job(db)
    with db.session() as s:
        s.get(Job, old).created_at = jobs._now().replace(year=2000)
        s.get(Job, running).created_at = jobs._now().replace(year=2000)
        jobs.claim(s, running, "w", 60)
    with db.session() as s:
        assert jobs.queued_without_message(s, older_than_s=60) == [old]
