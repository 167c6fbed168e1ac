"""Fair claims across tenants, budgets, waiting reasons, usage records and the atomic active-jobs cap,
on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from store import jobs, scheduling
from store.models import File, Job, UsageRecord
from store.tenants import create_tenant_and_key
from store.usage import QueuePolicy, RunMeter, budget, record_usage, tenant_periods, tenant_totals

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def tenant(db) -> tuple[str, str]:
    """A new tenant and a file of its own: ``(tenant_id, file_id)``."""
    with db.session() as s:
        t, _ = create_tenant_and_key(s, f"t-{uuid.uuid4().hex[:8]}")
        f = File(tenant_id=t.id, filename="t.jsonl", bytes=10, rows=1, object_key="files/x", item_fields=["prompt"])
        s.add(f)
        s.flush()
        return t.id, f.id


def submit(db, owner: tuple[str, str], n: int = 1, max_active: int | None = None) -> list[str]:
    """``n`` queued jobs of ``owner``, each created a millisecond after the previous one."""
    ids = []
    for _ in range(n):
        with db.session() as s:
            job = jobs.create_job(
                s,
                tenant_id=owner[0],
                model="toy",
                training_file_id=owner[1],
                reward={},
                hyperparameters={},
                total_steps=3,
                max_active=max_active,
            )
            ids.append(job.id)
    return ids


DEFAULT_POLICY = QueuePolicy()  # frozen: one instance serves every call


def take(db, policy: QueuePolicy = DEFAULT_POLICY, worker: str = "w") -> str | None:
    with db.session() as s:
        job = scheduling.claim_next(s, worker, 60, policy)
        return job.id if job else None


def use(db, job_id: str, seconds: float, policy: QueuePolicy = DEFAULT_POLICY) -> None:
    """Record ``seconds`` of device time of the job in the current period."""
    with db.session() as s:
        job = s.get(Job, job_id)
        s.add(
            UsageRecord(
                tenant_id=job.tenant_id,
                job_id=job_id,
                run_id=uuid.uuid4().hex,
                attempt=job.attempts,
                period_start=policy.period_start(jobs._now()),
                device_seconds=seconds,
                tokens_sampled=0,
                tokens_trained=0,
            )
        )


def test_a_tenant_with_many_queued_jobs_does_not_make_another_wait_behind_them(db):
    a, b = tenant(db), tenant(db)
    a_jobs = submit(db, a, 4)
    (b_job,) = submit(db, b)  # submitted after all of A's
    first = take(db)
    assert first == a_jobs[0], "equal tenants: the oldest job first"
    assert take(db) == b_job, "B has nothing running, A has one: B's turn"
    assert take(db) == a_jobs[1]
    with db.session() as s:  # the two running jobs finish; A has used more device time this period
        for job_id in (first, b_job):
            jobs.transition(s, s.get(Job, job_id), "succeeded")
    use(db, first, 50)
    use(db, b_job, 5)
    (b_next,) = submit(db, b)
    assert take(db) == b_next, "one running job each: the tenant that used less goes first"
    assert take(db) == a_jobs[2] and take(db) == a_jobs[3] and take(db) is None


def test_a_tenant_over_its_budget_waits_with_the_reason_and_others_run(db):
    policy = QueuePolicy(period_s=3600, budget_s=30)
    a, b = tenant(db), tenant(db)
    done, waiting = submit(db, a, 2)
    (b_job,) = submit(db, b)
    assert take(db, policy) == done
    use(db, done, 31, policy)
    with db.session() as s:
        jobs.transition(s, s.get(Job, done), "succeeded")
        for job_id in (waiting, b_job):
            s.get(Job, job_id).created_at = jobs._now() - timedelta(hours=1)
    assert take(db, policy) == b_job and take(db, policy) is None, "A's budget is used: its job waits"
    with db.session() as s:
        assert scheduling.jobs_needing_tokens(s, policy, older_than_s=60) == [], "no token for a job that cannot run"
        assert scheduling.jobs_needing_tokens(s, QueuePolicy(), older_than_s=60) == [waiting]
        w = scheduling.TenantQueue(s, policy, a[0]).waiting(s.get(Job, waiting))
        b_now = budget(s, policy, a[0])
    assert w.position == 1 and w.reason.startswith("tenant device-hour budget used (0.00861 of 0.00833 h")
    assert w.reason.endswith(f"until {b_now.period_end.isoformat()}") and b_now.exhausted
    assert b_now.period_end - b_now.period_start == timedelta(hours=1)
    assert take(db, QueuePolicy(period_s=3600, budget_s=60)) == waiting, "budget left: it runs"


def test_concurrent_workers_each_take_a_different_job(db):
    owners = [tenant(db) for _ in range(3)]
    submitted = {j for o in owners for j in submit(db, o, 2)}
    barrier, taken = threading.Barrier(8), []

    def worker(name: str) -> None:
        barrier.wait()
        while (job_id := take(db, worker=name)) is not None:
            taken.append(job_id)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(taken) == sorted(submitted), "every job taken exactly once"
    with db.session() as s:
        assert s.scalar(select(func.sum(Job.attempts))) == 6


def test_the_active_jobs_cap_holds_under_concurrent_submissions(db):
    owner = tenant(db)
    barrier, made, refused = threading.Barrier(10), [], []

    def submitter() -> None:
        barrier.wait()
        try:
            made.extend(submit(db, owner, max_active=4))
        except jobs.TooManyActiveJobs as exc:
            refused.append(exc.limit)

    threads = [threading.Thread(target=submitter) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(made) == 4 and refused == [4] * 6
    with db.session() as s:
        assert jobs.count_active(s, owner[0]) == 4


def test_run_meter_splits_device_time_at_period_boundaries_and_rewrites_absolute_values(db):
    policy = QueuePolicy(period_s=100)
    start = 1_000_050.0  # 50 s into a period
    meter = RunMeter(policy, prior=(7.0, 10, 20), started=start)
    meter.add_tokens(3, 5, at=start + 10)
    meter.add_tokens(4, 6, at=start + 60)  # in the next period
    rows, totals = meter.snapshot(now=start + 130)
    assert [(r[0].timestamp(), r[1], r[2], r[3]) for r in rows] == [(1_000_000, 50.0, 3, 5), (1_000_100, 80.0, 4, 6)]
    assert totals == (137.0, 17, 31)
    ((tid, fid),) = [tenant(db)]
    (job_id,) = submit(db, (tid, fid))
    for _ in range(2):  # a retried write counts nothing twice
        with db.session() as s:
            record_usage(s, job_id, tid, "run-1", 1, meter, now=start + 130)
    with db.session() as s:
        job = s.get(Job, job_id)
        assert (job.tokens_sampled, job.tokens_trained) == (17, 31) and job.device_seconds == 137.0
        assert s.scalar(select(func.count()).select_from(UsageRecord)) == 2
        assert [p["tokens_sampled"] for p in tenant_periods(s, tid, 10)] == [4, 3]
        assert tenant_totals(s, tid)["tokens_trained"] == 11 and tenant_totals(s, tid)["jobs"] == 1


@pytest.mark.parametrize("at,start", [(T0, T0.replace(hour=0)), (T0.replace(hour=23, minute=59), T0.replace(hour=0))])
def test_a_day_period_is_the_utc_calendar_day(at, start):
    policy = QueuePolicy(period_s=86400)
    assert policy.period_start(at) == start and policy.period_end(at) == start + timedelta(days=1)
