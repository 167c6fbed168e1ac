"""Tinker sessions as tenants' resources: the SDK's session routes (list, get, finish), weights info, the
dashboard's session list (``GET /v1/sessions``), and clear refusals of the SDK routes this service does not offer."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.bodies import StrictJsonRoute
from api.deps import SessionDep, TenantDep, TinkerTenantDep
from api.services import tinker_sessions as svc
from api.tinker_schemas import FinishSession, SessionList, SessionSummary, WeightsInfo

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=StrictJsonRoute)
dashboard = APIRouter(prefix="/v1", tags=["sessions"])


@router.get("/sessions")
def list_sessions(
    tenant: TinkerTenantDep,
    s: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict:
    return {"sessions": svc.list_sessions(s, tenant.id, limit, offset)}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return svc.session_json(s, tenant.id, session_id)


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, body: FinishSession, tenant: TinkerTenantDep, s: SessionDep) -> None:
    svc.finish(s, tenant.id, session_id, body.reason.type, body.detail)


@router.post("/weights_info")
def weights_info(body: WeightsInfo, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return svc.weights_info(s, tenant.id, body.tinker_path)


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", include_in_schema=False)
@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", include_in_schema=False)
def publish(run_id: str, checkpoint_id: str, _tenant: TinkerTenantDep) -> None:
    raise svc.unsupported("publishing checkpoints (every checkpoint is its tenant's only)")


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl", include_in_schema=False)
def checkpoint_ttl(run_id: str, checkpoint_id: str, _tenant: TinkerTenantDep) -> None:
    raise svc.unsupported("a checkpoint TTL (checkpoints are kept until deleted)")


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls", include_in_schema=False)
def external_urls(run_id: str, checkpoint_id: str, _tenant: TinkerTenantDep) -> None:
    raise svc.unsupported("external weights URLs (download the checkpoint's archive)")


@router.post("/retrieve_futures", include_in_schema=False)
@router.post("/cancel_future", include_in_schema=False)
def batch_futures(_tenant: TinkerTenantDep) -> None:
    raise svc.unsupported("batch retrieval and cancelling of futures (client/config turns both off)")


@router.post("/copy_weights", include_in_schema=False)
@router.post("/save_weights_external", include_in_schema=False)
def copy_weights(_tenant: TinkerTenantDep) -> None:
    raise svc.unsupported("copying weights to or from outside storage")


@dashboard.get("/sessions", response_model=SessionList)
def dashboard_sessions(
    tenant: TenantDep, s: SessionDep, limit: Annotated[int, Query(ge=1, le=100)] = 50
) -> SessionList:
    """The tenant's Tinker sessions, newest first (the dashboard shows them beside its jobs)."""
    rows = svc.summaries(s, tenant.id, limit)
    return SessionList(data=[SessionSummary.model_validate(r, from_attributes=True) for r in rows])
