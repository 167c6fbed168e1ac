"""/v1/usage: the tenant's device time and tokens per budget period, and its budget."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import SessionDep, SettingsDep, TenantDep
from api.schemas import UsageOut, error_responses
from api.services.usage import tenant_usage

router = APIRouter(prefix="/v1/usage", tags=["usage"])


@router.get("", response_model=UsageOut, responses=error_responses(401))
def get_usage(
    s: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    periods: Annotated[int, Query(ge=1, le=366, description="Most recent periods with usage")] = 30,
) -> UsageOut:
    return tenant_usage(s, settings, tenant, periods)
