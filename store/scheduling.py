"""Fair scheduling across tenants: which queued job a free worker takes, and why a job still waits.

A broker message is a token for one job slot: the worker that receives it takes the fairest queued
job at that moment (`claim_next`), whichever job the message named. Tokens are conserved (one per
submission, requeue and resend), so every queued job is taken by some token; a token that finds
nothing runnable is dropped, and the reaper sends one again for runnable jobs left without (see
`jobs_needing_tokens`).

Order: among tenants with queued jobs and budget left in the current period, the tenant with the
fewest running jobs first, then the one that used the least device time this period, then the one
whose oldest queued job is oldest; within a tenant, its oldest job. A worker considers only the jobs
that fit its devices (`fits`): a job asking for more waits for a worker that has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store import jobs
from store.models import Job
from store.usage import Budget, QueuePolicy, as_utc, budget, now_utc, period_device_seconds

RUNNING = jobs.HELD  # jobs a worker holds
# Picks tried per claim before giving up (each loses only to another worker's claim of the same job).
CLAIM_TRIES = 8


def fits(worker_devices: int) -> list:
    """The WHERE clauses of the jobs a worker with ``worker_devices`` devices may run."""
    return [Job.devices <= worker_devices]


@dataclass(frozen=True)
class Candidate:
    job_id: str
    tenant_id: str
    created_at: datetime
    running: int
    used_s: float


def candidates(
    s: Session, policy: QueuePolicy, job_filter: Sequence = (), now: datetime | None = None
) -> list[Candidate]:
    """Each tenant's oldest queued job, fairest first; tenants over their budget are left out.

    ``job_filter``: extra WHERE clauses on `Job` a worker applies to what it may run (the hook for
    workers that only run jobs whose resources they have)."""
    ranked = (
        select(
            Job.id,
            Job.tenant_id,
            Job.created_at,
            func.row_number().over(partition_by=Job.tenant_id, order_by=(Job.created_at, Job.id)).label("rn"),
        )
        .where(Job.status == "queued", *job_filter)
        .subquery()
    )
    heads = s.execute(select(ranked.c.id, ranked.c.tenant_id, ranked.c.created_at).where(ranked.c.rn == 1)).all()
    if not heads:
        return []
    tenants = {t for _, t, _ in heads}
    running = dict(
        s.execute(
            select(Job.tenant_id, func.count())
            .where(Job.tenant_id.in_(tenants), Job.status.in_(RUNNING))
            .group_by(Job.tenant_id)
        ).all()
    )
    used = period_device_seconds(s, tenants, policy.period_start(now or now_utc()))
    out = [
        Candidate(jid, tid, as_utc(created), int(running.get(tid, 0)), used.get(tid, 0.0))
        for jid, tid, created in heads
    ]
    if policy.budget_s > 0:
        out = [c for c in out if c.used_s < policy.budget_s]
    return sorted(out, key=lambda c: (c.running, c.used_s, c.created_at, c.job_id))


def claim_next(
    s: Session, worker_id: str, lease_seconds: float, policy: QueuePolicy, job_filter: Sequence = ()
) -> Job | None:
    """Take the fairest runnable queued job for ``worker_id`` (atomic per job: safe with any number of
    workers on PostgreSQL and SQLite); None when nothing may run now."""
    for _ in range(CLAIM_TRIES):
        picks = candidates(s, policy, job_filter)
        if not picks:
            return None
        for c in picks:
            job = jobs.claim_queued(s, c.job_id, worker_id, lease_seconds)
            if job is not None:
                return job
    return None


def jobs_needing_tokens(s: Session, policy: QueuePolicy, older_than_s: float) -> list[str]:
    """Queued jobs that waited ``older_than_s`` and may run now (their tenant has budget left). Called
    only when the broker queue is empty: their tokens were lost or dropped while they could not run."""
    waiting = jobs.queued_without_message(s, older_than_s)
    if not waiting or policy.budget_s <= 0:
        return waiting
    tenants = dict(s.execute(select(Job.id, Job.tenant_id).where(Job.id.in_(waiting))).all())
    used = period_device_seconds(s, set(tenants.values()), policy.period_start(now_utc()))
    return [j for j in waiting if used.get(tenants[j], 0.0) < policy.budget_s]


@dataclass(frozen=True)
class Waiting:
    """Why a queued job waits, in terms its tenant may know: its place among its own queued jobs
    (1 = its next), and a reason."""

    position: int
    reason: str


class TenantQueue:
    """A tenant's view of its queued jobs, loaded once per request (a job list reads it once).

    ``worker_devices``: the devices of this service's workers (the operator's ``GSPO_WORKER_DEVICES``)."""

    def __init__(self, s: Session, policy: QueuePolicy, tenant_id: str, worker_devices: int = 1) -> None:
        self.s, self.policy, self.tenant_id = s, policy, tenant_id
        self.worker_devices = worker_devices
        self._order: dict[str, int] | None = None
        self._budget: Budget | None = None

    def _load(self) -> tuple[dict[str, int], Budget]:
        ids = self.s.scalars(
            select(Job.id)
            .where(Job.tenant_id == self.tenant_id, Job.status == "queued")
            .order_by(Job.created_at, Job.id)
        )
        return {jid: i for i, jid in enumerate(ids)}, budget(self.s, self.policy, self.tenant_id)

    def waiting(self, job: Job) -> Waiting | None:
        """None unless the job is queued."""
        if job.status != "queued":
            return None
        if self._order is None or self._budget is None or job.id not in self._order:
            self._order, self._budget = self._load()
        ahead = self._order.get(job.id, 0)
        b = self._budget
        if b.exhausted:
            reason = (
                f"tenant device-hour budget used ({b.used_s / 3600:.3g} of {b.budget_s / 3600:.3g} h this "
                f"period) until {b.period_end.isoformat()}"
            )
        elif job.devices > self.worker_devices:
            reason = (
                f"waiting for a worker with {job.devices} devices (resources.devices); "
                f"this service's workers have {self.worker_devices}"
            )
        elif ahead:
            reason = f"queued: {ahead} of your jobs ahead"
        else:
            reason = "waiting for a free worker"
        return Waiting(ahead + 1, reason)
