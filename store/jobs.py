"""Job state machine and worker leases: the ONE place a job's status changes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import cast

from sqlalchemy import CursorResult, Result, and_, func, or_, select, update
from sqlalchemy.orm import Session

from store import webhooks
from store.models import Job, JobEvent, Tenant, utcnow

TERMINAL = {"succeeded", "failed", "cancelled"}
# Statuses in which a worker holds the job's lease (``pausing``: asked to pause, it stops within seconds).
HELD = ("running", "cancelling", "pausing")
# Unfinished jobs: their files and checkpoints are in use. ``paused`` holds no worker and does not count
# against the tenant's cap of active jobs (`count_active`); resuming it is checked against the cap.
ACTIVE = {"queued", *HELD, "paused"}
LEGAL = {
    "queued": {"running", "cancelled", "failed", "paused"},
    "running": {"succeeded", "failed", "cancelling", "queued", "pausing"},
    "cancelling": {"cancelled", "failed", "succeeded"},
    # A pausing run stops within seconds (the step in flight dropped) and is paused, unless it ends first; a
    # resume before it stopped takes it back (running), a cancel turns it into cancelling.
    "pausing": {"paused", "running", "cancelling", "succeeded", "failed"},
    "paused": {"queued", "cancelled"},
}


class IllegalTransition(ValueError):
    """A status change the state machine refuses (e.g. succeeded -> running)."""


class LeaseLost(RuntimeError):
    """The worker writing no longer holds the job: another worker took it over, or it was settled."""


def _now() -> datetime:
    return datetime.now(UTC)


def _rowcount(res: Result) -> int:
    """The rows an UPDATE matched. Session.execute types every result as Result; an UPDATE's is the
    cursor's CursorResult, which carries the count."""
    return cast(CursorResult, res).rowcount


def add_event(s: Session, job_id: str, kind: str, message: str, data: dict | None = None) -> JobEvent:
    ev = JobEvent(job_id=job_id, kind=kind, message=message, data=data)
    s.add(ev)
    s.flush()
    return ev


class TooManyActiveJobs(RuntimeError):
    """The tenant already has its maximum of queued and running jobs (paused ones not counted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"at most {limit} queued or running jobs per tenant")


def lock_tenant(s: Session, tenant_id: str) -> None:
    """Serialize the tenant's job submissions until this transaction ends: its row locked on PostgreSQL,
    the database's write lock taken on SQLite (where the UPDATE opens the transaction, so no older
    snapshot is read under the lock)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    else:
        s.execute(
            update(Tenant)
            .where(Tenant.id == tenant_id)
            .values(name=Tenant.name)
            .execution_options(synchronize_session=False)
        )


def create_job(
    s: Session,
    *,
    tenant_id: str,
    model: str,
    training_file_id: str | None,
    reward: dict,
    hyperparameters: dict,
    total_steps: int,
    validation_file_id: str | None = None,
    name: str | None = None,
    metadata: dict | None = None,
    seed: int = 0,
    idempotency_key: str | None = None,
    max_attempts: int = 3,
    max_wall_seconds: int | None = None,
    max_active: int | None = None,
    tools: list | None = None,
    devices: int = 1,
    environment: dict | None = None,
) -> Job:
    """Insert a ``queued`` job and its first status event (the caller enqueues it after commit).

    With ``max_active``, the tenant's active jobs are counted under `lock_tenant` in this transaction,
    so concurrent submissions cannot pass the cap (`TooManyActiveJobs`): the caller commits soon after.
    """
    if max_active is not None:
        lock_tenant(s, tenant_id)
        if count_active(s, tenant_id) >= max_active:
            raise TooManyActiveJobs(max_active)
    job = Job(
        tenant_id=tenant_id,
        name=name,
        model=model,
        training_file_id=training_file_id,
        validation_file_id=validation_file_id,
        reward=reward,
        tools=tools or None,
        environment=environment,
        hyperparameters=hyperparameters,
        job_metadata=metadata or {},
        seed=seed,
        status="queued",
        total_steps=total_steps,
        idempotency_key=idempotency_key,
        max_attempts=max_attempts,
        devices=devices,
        max_wall_seconds=max_wall_seconds,
    )
    s.add(job)
    s.flush()
    add_event(s, job.id, "status", "queued", {"status": "queued"})
    return job


def transition(s: Session, job: Job, to: str, *, error: str | None = None) -> Job:
    """Move ``job`` to ``to`` if legal, stamping times and recording a status event; a terminal status
    also writes the tenant's webhook deliveries (store.webhooks), in the same transaction."""
    if to not in LEGAL.get(job.status, set()):
        raise IllegalTransition(f"job {job.id}: {job.status} -> {to} is not allowed")
    job.status = to
    if to == "running" and job.started_at is None:
        job.started_at = utcnow()
    if to in TERMINAL:
        job.finished_at = utcnow()
        job.worker_id, job.lease_until = None, None
    if to in ("queued", "paused"):  # no worker holds it any more
        job.worker_id, job.lease_until = None, None
    if error is not None:
        job.error = error
    add_event(s, job.id, "status", to if not error else f"{to}: {error}", {"status": to, "error": error})
    if to in TERMINAL:  # the outbox: the event is sent if and only if this status is committed
        webhooks.enqueue_job_event(s, job, to)
    return job


def _stale(now: datetime):
    """A running job whose holder's lease expired, still within its retry budget."""
    return and_(
        Job.status.in_(HELD),
        or_(Job.lease_until.is_(None), Job.lease_until < now),
        Job.attempts < Job.max_attempts,
    )


def _take(s: Session, job_id: str, worker_id: str, lease_seconds: float, runnable) -> Job | None:
    """Give ``worker_id`` the job's lease if ``runnable(now)`` holds for its row (one atomic UPDATE, so
    of concurrent takers exactly one wins): the job becomes ``running``, attempts + 1."""
    now = _now()
    res = s.execute(
        update(Job)
        .where(Job.id == job_id)
        .where(runnable(now))
        .values(
            worker_id=worker_id,
            lease_until=now + timedelta(seconds=lease_seconds),
            heartbeat_at=now,
            attempts=Job.attempts + 1,
        )
        .execution_options(synchronize_session=False)
    )
    if _rowcount(res) != 1:
        return None
    job = s.get_one(Job, job_id, populate_existing=True)
    if job.status == "queued":
        transition(s, job, "running")
    add_event(s, job.id, "log", f"attempt {job.attempts} started on {worker_id}")
    return job


def claim(s: Session, job_id: str, worker_id: str, lease_seconds: float) -> Job | None:
    """Take the job's lease if it is queued or its holder's lease expired (atomic UPDATE).

    Returns the job (now ``running``, attempts + 1) or None when another live worker holds it or
    it is no longer runnable: a duplicated delivery then exits at once. A stale lease of a job past
    its retry budget is not taken over: the reaper fails that job.
    """
    return _take(s, job_id, worker_id, lease_seconds, lambda now: or_(Job.status == "queued", _stale(now)))


def claim_queued(s: Session, job_id: str, worker_id: str, lease_seconds: float) -> Job | None:
    """Take a queued job (the scheduler's pick, `store.scheduling.claim_next`); None if another worker
    took it first."""
    return _take(s, job_id, worker_id, lease_seconds, lambda now: Job.status == "queued")


def claim_stale(s: Session, job_id: str, worker_id: str, lease_seconds: float, job_filter: Sequence = ()) -> Job | None:
    """Take over a running job whose holder's lease expired (a redelivered message of a job whose
    worker died); None when its lease is alive, the job is not running, or it fails ``job_filter``
    (`store.scheduling.fits`)."""
    return _take(s, job_id, worker_id, lease_seconds, lambda now: and_(_stale(now), *job_filter))


def heartbeat(s: Session, job_id: str, worker_id: str, lease_seconds: float) -> bool:
    """Renew the lease; False when this worker no longer holds it (it must stop)."""
    now = _now()
    res = s.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status.in_(HELD))
        .values(lease_until=now + timedelta(seconds=lease_seconds), heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    return _rowcount(res) == 1


def hold(s: Session, job_id: str, worker_id: str) -> None:
    """Fence a worker's write: raise `LeaseLost` unless ``worker_id`` still holds the job.

    Called first in every transaction in which a worker writes the job's progress or status. The
    UPDATE locks the job's row until the transaction ends (the whole database on SQLite), so a
    takeover (`claim`, `reap`) waits for a write in flight, and a worker that stalled past its lease
    or was cut off from the database cannot write over its successor's steps, checkpoints or status
    once the job has been taken over.
    """
    res = s.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status.in_(HELD))
        .values(heartbeat_at=_now())
        .execution_options(synchronize_session=False)
    )
    if _rowcount(res) != 1:
        raise LeaseLost(f"job {job_id}: worker {worker_id} no longer holds it")


def end_lease(s: Session, job_id: str, worker_id: str) -> None:
    """Expire the holder's lease now: its attempt was lost (a rank of the job died) and the reaper requeues
    the job, or fails it past its retry budget, exactly as when a worker dies, without waiting out the lease."""
    hold(s, job_id, worker_id)
    s.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id)
        .values(lease_until=_now() - timedelta(seconds=1))
        .execution_options(synchronize_session=False)
    )


def lock_job(s: Session, job: Job) -> Job:
    """Lock the job's row until this transaction ends and re-read it, so that a user's request decides on
    the status a worker's concurrent write (fenced by `hold`, which locks the same row) left, never on a
    stale read: PostgreSQL's row lock, SQLite's write lock (its UPDATE opens the transaction)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(select(Job).where(Job.id == job.id).with_for_update().execution_options(populate_existing=True))
    else:
        s.execute(
            update(Job).where(Job.id == job.id).values(status=Job.status).execution_options(synchronize_session=False)
        )
        s.refresh(job)
    return job


def request_cancel(s: Session, job: Job) -> Job:
    """Queued and paused jobs are cancelled at once; running (or pausing) ones go to ``cancelling``
    (seen within seconds)."""
    lock_job(s, job)
    if job.status in ("queued", "paused"):
        return transition(s, job, "cancelled")
    if job.status in ("running", "pausing"):
        return transition(s, job, "cancelling")
    return job


def request_pause(s: Session, job: Job) -> Job:
    """Queued jobs are paused at once (the scheduler takes only queued ones); running ones go to
    ``pausing``: the worker stops within seconds (mid-step if need be), checkpoints, then settles ``paused``.
    A pausing or paused job is left as it is; any other raises `IllegalTransition`."""
    lock_job(s, job)
    if job.status in ("pausing", "paused"):
        return job
    return transition(s, job, "paused" if job.status == "queued" else "pausing")


def request_resume(s: Session, job: Job, max_active: int | None = None) -> bool:
    """A paused job goes back to the queue (it continues from its latest checkpoint); a pausing one back to
    running (its worker has not stopped yet). Returns True when the job was queued: the caller sends it a
    token after commit. ``max_active``: the tenant's cap, checked as at submission (`TooManyActiveJobs`)."""
    lock_job(s, job)
    if job.status in ("queued", "running"):
        return False
    if job.status == "pausing":
        transition(s, job, "running")
        return False
    if job.status == "paused" and max_active is not None:
        lock_tenant(s, job.tenant_id)
        if count_active(s, job.tenant_id) >= max_active:
            raise TooManyActiveJobs(max_active)
    transition(s, job, "queued")
    return True


def stale_jobs(s: Session) -> list[Job]:
    """Running/cancelling jobs whose lease expired (their worker died or hung), row-locked so that
    concurrent reapers (one per worker) on PostgreSQL never handle the same job twice."""
    q = select(Job).where(Job.status.in_(HELD), Job.lease_until < _now()).with_for_update(skip_locked=True)
    return list(s.scalars(q))


def reap(s: Session) -> tuple[list[str], list[str]]:
    """Requeue jobs with stale leases; fail those past their retry budget. Returns (requeued, failed).
    A cancelling job whose worker died is cancelled, a pausing one paused (at its latest checkpoint)."""
    requeued, failed = [], []
    for job in stale_jobs(s):
        if job.status == "cancelling":
            transition(s, job, "cancelled")
        elif job.status == "pausing":
            transition(s, job, "paused")
        elif job.attempts >= job.max_attempts:
            transition(
                s, job, "failed", error=f"worker lost {job.attempts} times (lease expired); retry budget exhausted"
            )
            failed.append(job.id)
        else:
            add_event(s, job.id, "log", f"lease of {job.worker_id} expired; requeued")
            transition(s, job, "queued")
            requeued.append(job.id)
    return requeued, failed


def queued_without_message(s: Session, older_than_s: float) -> list[str]:
    """Queued jobs that have waited ``older_than_s`` since they were created or last ran. Called only
    when the broker queue is empty, these are jobs left without a token: a message lost (a broker
    restarted without persistence, a publish that failed after the commit) or dropped while the job could
    not run (its tenant's budget was used). The reaper sends tokens again (`store.scheduling`)."""
    cutoff = _now() - timedelta(seconds=older_than_s)
    q = (
        select(Job.id)
        .where(
            Job.status == "queued", Job.created_at < cutoff, or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < cutoff)
        )
        .order_by(Job.created_at)
    )
    return list(s.scalars(q))


def count_active(s: Session, tenant_id: str) -> int:
    """The tenant's jobs that count against its cap: queued or held by a worker (not paused ones)."""
    counted = ("queued", *HELD)
    return int(
        s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id, Job.status.in_(counted))) or 0
    )
