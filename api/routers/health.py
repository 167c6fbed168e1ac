"""Liveness, readiness (database + broker reachable, which sandbox isolates python graders) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import DatabaseDep, MetricsAuthDep, MonitoringDep, SettingsDep
from api.schemas import HealthOut, ReadyOut
from api.services import health as svc

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut)
async def healthz() -> HealthOut:  # on the event loop: no thread to wait for while the pool is busy
    return HealthOut()


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "The database or the broker is unreachable"}},
)
async def readyz(db: DatabaseDep, settings: SettingsDep) -> JSONResponse:
    ready, serving = await svc.readiness(db, settings)
    return JSONResponse(ready.model_dump(exclude_none=True), status_code=200 if serving else 503)


@router.get("/metrics", include_in_schema=False)
def prometheus(_: MetricsAuthDep, monitoring: MonitoringDep) -> Response:
    """Prometheus text; needs ``Authorization: Bearer $GSPO_METRICS_TOKEN`` (404 while it is unset)."""
    return Response(monitoring.scrape(), media_type=CONTENT_TYPE_LATEST)
