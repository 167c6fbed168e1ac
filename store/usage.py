"""Usage accounting: device time and tokens per run of a job and per budget period; tenants' budgets."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.models import Job, UsageRecord
from store.settings import Settings

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A run rewrites the rows of its latest periods only (older ones no longer change).
ROWS_PER_WRITE = 64


@dataclass(frozen=True)
class QueuePolicy:
    """The operator's scheduling limits: budget periods (epoch-aligned, ``period_s`` long) and the device
    seconds a tenant may use per period (0: no budget)."""

    period_s: int = 86400
    budget_s: float = 0.0

    @classmethod
    def of(cls, settings: Settings) -> QueuePolicy:
        return cls(period_s=settings.budget_period_seconds, budget_s=settings.tenant_device_hours_per_period * 3600.0)

    def period_start(self, at: datetime) -> datetime:
        """Start of the period holding ``at``: periods are aligned to the Unix epoch (a day: UTC midnight)."""
        secs = int((as_utc(at) - EPOCH).total_seconds() // self.period_s) * self.period_s
        return EPOCH + timedelta(seconds=secs)

    def period_end(self, at: datetime) -> datetime:
        return self.period_start(at) + timedelta(seconds=self.period_s)


def as_utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes (stored as UTC)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def now_utc() -> datetime:
    return datetime.now(UTC)


class RunMeter:
    """Device time and tokens of one run (one claim of a job), split by budget period; thread-safe.

    ``prior`` is the job's usage before this run (its earlier attempts). Snapshots hold absolute values,
    so writing one twice (a retried transaction) or out of order never counts anything twice.
    """

    def __init__(
        self, policy: QueuePolicy, prior: tuple[float, int, int] = (0.0, 0, 0), started: float | None = None
    ) -> None:
        self.policy, self.prior = policy, prior
        self.started = time.time() if started is None else started
        self._tokens: dict[datetime, list[int]] = {}
        self._lock = threading.Lock()

    def add_tokens(self, sampled: int, trained: int, at: float | None = None) -> None:
        key = self.policy.period_start(datetime.fromtimestamp(time.time() if at is None else at, UTC))
        with self._lock:
            acc = self._tokens.setdefault(key, [0, 0])
            acc[0] += int(sampled)
            acc[1] += int(trained)

    def device_seconds(self, now: float | None = None) -> float:
        """This run's device time plus the earlier attempts'."""
        return self.prior[0] + max(0.0, (time.time() if now is None else now) - self.started)

    def snapshot(
        self, now: float | None = None
    ) -> tuple[list[tuple[datetime, float, int, int]], tuple[float, int, int]]:
        """``(rows, totals)``: per period ``(period_start, device_s, sampled, trained)`` of this run (its
        latest periods), and the job's totals over all its runs."""
        now = time.time() if now is None else now
        p = self.policy.period_s
        rows: dict[datetime, list] = {}
        first = (self.policy.period_start(datetime.fromtimestamp(now, UTC)) - EPOCH).total_seconds()
        t = max(self.started, first - (ROWS_PER_WRITE - 1) * p)
        while t < now:  # the run's wall time [started, now] cut at period boundaries (its latest periods)
            start = self.policy.period_start(datetime.fromtimestamp(t, UTC))
            end = min(now, (start - EPOCH).total_seconds() + p)
            rows[start] = [end - t, 0, 0]
            t = end
        with self._lock:
            for start, (sampled, trained) in self._tokens.items():
                rows.setdefault(start, [0.0, 0, 0])[1:] = [sampled, trained]
            sampled = sum(v[0] for v in self._tokens.values())
            trained = sum(v[1] for v in self._tokens.values())
        out = [(k, *rows[k]) for k in sorted(rows)][-ROWS_PER_WRITE:]  # tokens come from these periods too
        totals = (self.device_seconds(now), self.prior[1] + sampled, self.prior[2] + trained)
        return out, totals


def _upsert_row(s: Session, values: dict) -> None:
    dialect = s.get_bind().dialect.name
    ins = (pg_insert if dialect == "postgresql" else sqlite_insert)(UsageRecord.__table__).values(**values)
    s.execute(
        ins.on_conflict_do_update(
            index_elements=["job_id", "run_id", "period_start"],
            set_={c: ins.excluded[c] for c in ("device_seconds", "tokens_sampled", "tokens_trained")},
        )
    )


def record_usage(
    s: Session, job: Job | str, tenant_id: str, run_id: str, attempt: int, meter: RunMeter, now: float | None = None
) -> None:
    """Write a run's usage (its periods' rows and the job's totals) from a snapshot taken now: call it
    after the transaction took the job's row lock (`store.jobs.hold`), so snapshots land in order."""
    job_id = job if isinstance(job, str) else job.id
    rows, (device_s, sampled, trained) = meter.snapshot(now)
    for start, secs, n_sampled, n_trained in rows:
        _upsert_row(
            s,
            {
                "tenant_id": tenant_id,
                "job_id": job_id,
                "run_id": run_id,
                "attempt": attempt,
                "period_start": start,
                "device_seconds": secs,
                "tokens_sampled": n_sampled,
                "tokens_trained": n_trained,
            },
        )
    s.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(device_seconds=device_s, tokens_sampled=sampled, tokens_trained=trained)
        .execution_options(synchronize_session=False)
    )


def period_device_seconds(s: Session, tenant_ids, period_start: datetime) -> dict[str, float]:
    """Device seconds each tenant used in the period starting at ``period_start``."""
    ids = list(tenant_ids)
    if not ids:
        return {}
    q = (
        select(UsageRecord.tenant_id, func.sum(UsageRecord.device_seconds))
        .where(UsageRecord.tenant_id.in_(ids), UsageRecord.period_start == period_start)
        .group_by(UsageRecord.tenant_id)
    )
    return {tid: float(v or 0.0) for tid, v in s.execute(q).all()}


@dataclass(frozen=True)
class Budget:
    """A tenant's budget in the current period."""

    used_s: float
    budget_s: float  # 0: no budget
    period_start: datetime
    period_end: datetime

    @property
    def exhausted(self) -> bool:
        return self.budget_s > 0 and self.used_s >= self.budget_s


def budget(s: Session, policy: QueuePolicy, tenant_id: str, now: datetime | None = None) -> Budget:
    start = policy.period_start(now or now_utc())
    used = period_device_seconds(s, [tenant_id], start).get(tenant_id, 0.0)
    return Budget(used, policy.budget_s, start, start + timedelta(seconds=policy.period_s))


def tenant_periods(s: Session, tenant_id: str, limit: int) -> list[dict]:
    """The tenant's usage per period, newest first (periods with usage only)."""
    q = (
        select(
            UsageRecord.period_start,
            func.sum(UsageRecord.device_seconds),
            func.sum(UsageRecord.tokens_sampled),
            func.sum(UsageRecord.tokens_trained),
            func.count(func.distinct(UsageRecord.job_id)),
        )
        .where(UsageRecord.tenant_id == tenant_id)
        .group_by(UsageRecord.period_start)
        .order_by(UsageRecord.period_start.desc())
        .limit(limit)
    )
    return [
        {
            "period_start": as_utc(start),
            "device_seconds": float(dev or 0),
            "tokens_sampled": int(smp or 0),
            "tokens_trained": int(trn or 0),
            "jobs": int(n or 0),
        }
        for start, dev, smp, trn, n in s.execute(q).all()
    ]


def tenant_totals(s: Session, tenant_id: str) -> dict:
    """The tenant's usage over all time."""
    dev, smp, trn, n = s.execute(
        select(
            func.sum(UsageRecord.device_seconds),
            func.sum(UsageRecord.tokens_sampled),
            func.sum(UsageRecord.tokens_trained),
            func.count(func.distinct(UsageRecord.job_id)),
        ).where(UsageRecord.tenant_id == tenant_id)
    ).one()
    return {
        "device_seconds": float(dev or 0),
        "tokens_sampled": int(smp or 0),
        "tokens_trained": int(trn or 0),
        "jobs": int(n or 0),
    }
