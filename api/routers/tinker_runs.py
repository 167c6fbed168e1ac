"""Tinker-compatible REST routes: a tenant's training runs and their checkpoints (list, archive download, delete)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse

from api.bodies import StrictJsonRoute
from api.deps import ObjectsDep, SessionDep, SettingsDep, TinkerTenantDep
from api.services import tinker_runs as svc
from api.services.archive import stream_tar_gz

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=StrictJsonRoute)


@router.get("/training_runs")
def list_training_runs(
    tenant: TinkerTenantDep,
    s: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict:
    runs = svc.training_runs(s, tenant.id, limit + 1, offset)
    items = [svc.training_run_json(r, tenant.name, svc.checkpoints_of(s, tenant.id, r.id)) for r in runs[:limit]]
    return {"training_runs": items, "cursor": {"offset": offset, "limit": limit, "total_count": offset + len(runs)}}


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    run = svc.run_of(s, tenant.id, run_id)
    return svc.training_run_json(run, tenant.name, svc.checkpoints_of(s, tenant.id, run.id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    svc.run_of(s, tenant.id, run_id)
    return {"checkpoints": [svc.checkpoint_json(c) for c in svc.checkpoints_of(s, tenant.id, run_id)]}


@router.get("/checkpoints")
def list_checkpoints(tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return {"checkpoints": [svc.checkpoint_json(c) for c in svc.checkpoints_of(s, tenant.id, None)]}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/archive")
def download_checkpoint(
    run_id: str, checkpoint_id: str, tenant: TinkerTenantDep, s: SessionDep, objects: ObjectsDep
) -> StreamingResponse:
    """A sampler checkpoint's Hugging Face export as one .tar.gz (it loads in transformers and vLLM as is)."""
    members, root = svc.archive_of(s, objects, tenant.id, run_id, checkpoint_id)
    return StreamingResponse(
        stream_tar_gz(objects, members, root),
        media_type="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{root}.tar.gz"'},
    )


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
def delete_checkpoint(
    run_id: str, checkpoint_id: str, tenant: TinkerTenantDep, s: SessionDep, objects: ObjectsDep, settings: SettingsDep
) -> Response:
    svc.delete_checkpoint(s, objects, settings.data_dir, tenant.id, run_id, checkpoint_id)
    return Response(status_code=204)
