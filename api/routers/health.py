"""Liveness, readiness (database + broker reachable, which sandbox isolates python graders) and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api.deps import MetricsAuthDep, SettingsDep
from gspo_core.rewards import GraderPolicy
from gspo_core.rewards.isolation import isolation_for
from store.queue import broker_reachable

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz():  # on the event loop: no thread to wait for while the pool is busy
    return {"status": "ok"}


def _db_ok(db) -> bool:
    try:
        with db.session() as s:
            s.execute(text("SELECT 1"))
        return True
    except Exception:
        return False


@router.get("/readyz")
async def readyz(request: Request, settings: SettingsDep):
    db_ok, broker_ok, iso = await asyncio.gather(
        asyncio.to_thread(_db_ok, request.app.state.db),
        asyncio.to_thread(broker_reachable, settings),
        asyncio.to_thread(isolation_for, GraderPolicy.from_mapping(settings.grader_policy())),
    )
    # Python graders: "bubblewrap" (isolated), "weak" (the operator allowed rlimits only) or "refused".
    body = {
        "database": "ok" if db_ok else "unreachable",
        "broker": "ok" if broker_ok else "unreachable",
        "sandbox": iso.mode,
        **({"sandbox_reason": iso.summary} if iso.reason else {}),
    }
    return JSONResponse(body, status_code=200 if db_ok and broker_ok else 503)


@router.get("/metrics", include_in_schema=False)
def prometheus(request: Request, _: MetricsAuthDep):
    """Prometheus text; needs ``Authorization: Bearer $GSPO_METRICS_TOKEN`` (404 while it is unset)."""
    request.app.state.observe_jobs()
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
