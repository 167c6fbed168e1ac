"""Tinker-compatible REST routes: a tenant's training runs and their checkpoints (list, archive download, delete)."""

from __future__ import annotations

import shutil
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse

from api.bodies import StrictJsonRoute
from api.deps import ObjectsDep, SessionDep, TinkerTenantDep
from api.errors import not_found
from api.services import tinker as svc
from api.services.archive import archive_members, stream_tar_gz
from store import tinker
from store.models import TinkerModel

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=StrictJsonRoute)


def _run(s, tenant_id: str, run_id: str) -> TinkerModel:
    row = tinker.owned(s, TinkerModel, run_id, tenant_id)
    if row is None or row.kind != "training":
        raise not_found("training run", run_id)
    return row


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
    run = _run(s, tenant.id, run_id)
    return svc.training_run_json(run, tenant.name, svc.checkpoints_of(s, tenant.id, run.id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, tenant: TinkerTenantDep, s: SessionDep) -> dict:
    _run(s, tenant.id, run_id)
    return {"checkpoints": [svc.checkpoint_json(c) for c in svc.checkpoints_of(s, tenant.id, run_id)]}


@router.get("/checkpoints")
def list_checkpoints(tenant: TinkerTenantDep, s: SessionDep) -> dict:
    return {"checkpoints": [svc.checkpoint_json(c) for c in svc.checkpoints_of(s, tenant.id, None)]}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/archive")
def download_checkpoint(
    run_id: str, checkpoint_id: str, tenant: TinkerTenantDep, s: SessionDep, objects: ObjectsDep
) -> StreamingResponse:
    """A sampler checkpoint's Hugging Face export as one .tar.gz (it loads in transformers and vLLM as is)."""
    ckpt = svc.resolve_path(s, tenant.id, f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
    members = archive_members(objects, ckpt.object_prefix)
    if not members:
        raise not_found("archive of checkpoint", checkpoint_id)
    filename = f"{run_id}-{ckpt.name}.tar.gz"
    return StreamingResponse(
        stream_tar_gz(objects, members, f"{run_id}-{ckpt.name}"),
        media_type="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
def delete_checkpoint(
    run_id: str, checkpoint_id: str, tenant: TinkerTenantDep, s: SessionDep, objects: ObjectsDep
) -> Response:
    ckpt = svc.resolve_path(s, tenant.id, f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
    objects.delete_prefix(ckpt.object_prefix)
    shutil.rmtree(ckpt.directory, ignore_errors=True)  # the worker's copy, where the API shares its disk
    s.delete(ckpt)
    s.commit()
    return Response(status_code=204)
