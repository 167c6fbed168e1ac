"""/v1/files: upload (validated JSONL), list, get, content, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.deps import FileDep, LimitsDep, ObjectsDep, SessionDep, SettingsDep, TenantDep
from api.schemas import ErrorBody, FileOut, Page
from api.services import files as svc
from api.services.deletion import delete_file as delete_file_rows
from api.services.deletion import purge
from store.models import File

router = APIRouter(prefix="/v1/files", tags=["files"])
ERRORS = {
    400: {"model": ErrorBody},
    401: {"model": ErrorBody},
    404: {"model": ErrorBody},
    413: {"model": ErrorBody},
    422: {"model": ErrorBody},
}
# The body is read by the handler (after the key and the tenant's upload slot are checked), so its
# shape is declared here for the OpenAPI document.
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "JSONL: one object per line with `prompt` or `messages`",
                        }
                    },
                }
            }
        },
    }
}


def _out(f: File) -> FileOut:
    return FileOut(
        id=f.id,
        filename=f.filename,
        bytes=f.bytes,
        rows=f.rows,
        item_fields=f.item_fields or [],
        created_at=f.created_at,
    )


@router.post(
    "",
    response_model=FileOut,
    status_code=201,
    openapi_extra=UPLOAD_BODY,
    responses={429: {"model": ErrorBody}, 503: {"model": ErrorBody}, **ERRORS},
)
async def upload_file(request: Request, settings: SettingsDep, limits: LimitsDep, tenant: TenantDep):
    """At most GSPO_MAX_UPLOADS_PER_TENANT at once (429); a tenant's files hold at most
    GSPO_MAX_FILE_STORAGE_BYTES_PER_TENANT (413)."""
    return _out(await svc.upload(request, settings, limits, tenant))


@router.get("", response_model=Page[FileOut], responses=ERRORS)
def list_files(s: SessionDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    rows = s.scalars(select(File).where(File.tenant_id == tenant.id).order_by(File.created_at.desc()).limit(limit))
    return Page[FileOut](data=[_out(f) for f in rows])


@router.get("/{file_id}", response_model=FileOut, responses=ERRORS)
def get_file(f: FileDep):
    return _out(f)


@router.get("/{file_id}/content", responses={200: {"content": {"application/jsonl": {}}}, **ERRORS})
def file_content(f: FileDep, objects: ObjectsDep):
    return StreamingResponse(
        svc.open_content(objects, f.object_key),
        media_type="application/jsonl",
        headers={"Content-Disposition": f'attachment; filename="{f.id}.jsonl"'},
    )


@router.delete("/{file_id}", status_code=204, responses={409: {"model": ErrorBody}, **ERRORS})
def delete_file(f: FileDep, s: SessionDep, request: Request):
    """409 while a queued or running job uses it; jobs that finished keep `training_file: null`."""
    delete_file_rows(s, f)
    purge(request.app.state.db, request.app.state.objects)
