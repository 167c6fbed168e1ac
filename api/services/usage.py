"""A tenant's usage per budget period, its totals and what is left of its budget."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from api.schemas import UsageOut, UsagePeriod, UsageTotals
from store import usage as store_usage
from store.models import Tenant
from store.settings import Settings
from store.usage import QueuePolicy


def tenant_usage(s: Session, settings: Settings, tenant: Tenant, periods: int) -> UsageOut:
    policy = QueuePolicy.of(settings)
    length = timedelta(seconds=policy.period_s)
    rows = store_usage.tenant_periods(s, tenant.id, periods)
    budget = store_usage.budget(s, policy, tenant.id)
    current = next((r for r in rows if r["period_start"] == budget.period_start), None) or {
        "period_start": budget.period_start,
        "device_seconds": 0.0,
        "tokens_sampled": 0,
        "tokens_trained": 0,
        "jobs": 0,
    }
    hours = policy.budget_s / 3600 if policy.budget_s > 0 else None
    return UsageOut(
        period_seconds=policy.period_s,
        budget_device_hours=hours,
        current=UsagePeriod(**current, period_end=current["period_start"] + length),
        budget_left_device_hours=max(0.0, hours - current["device_seconds"] / 3600) if hours is not None else None,
        budget_exhausted_until=budget.period_end if budget.exhausted else None,
        periods=[UsagePeriod(**r, period_end=r["period_start"] + length) for r in rows],
        total=UsageTotals(**store_usage.tenant_totals(s, tenant.id)),
    )
