"""/v1/files: upload (validated JSONL), list, get, content, delete."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from api.deps import DatabaseDep, FileDep, LimitsDep, ObjectsDep, SessionDep, SettingsDep, TenantDep
from api.schemas import FileOut, FilePage, error_responses
from api.services import deletion
from api.services import files as svc

router = APIRouter(prefix="/v1/files", tags=["files"])
ERRORS = error_responses(400, 401, 404, 413, 422)
# The body is read by the handler (after the key and the tenant's upload slot are checked), so its
# shape is declared here for the OpenAPI document.
UPLOAD_BODY: dict[str, Any] = {
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
                        },
                        "purpose": {"type": "string", "enum": ["fine-tune"], "description": "OpenAI's; optional"},
                    },
                }
            }
        },
    }
}


@router.post(
    "",
    response_model=FileOut,
    status_code=201,
    openapi_extra=UPLOAD_BODY,
    responses={**error_responses(429, 503), **ERRORS},
)
async def upload_file(
    request: Request,
    db: DatabaseDep,
    objects: ObjectsDep,
    settings: SettingsDep,
    limits: LimitsDep,
    tenant: TenantDep,
) -> FileOut:
    """At most GSPO_MAX_UPLOADS_PER_TENANT at once (429); a tenant's files hold at most
    GSPO_MAX_FILE_STORAGE_BYTES_PER_TENANT (413)."""
    return await svc.upload(lambda: request.form(max_files=1, max_fields=8), db, objects, settings, limits, tenant)


@router.get("", response_model=FilePage, responses=ERRORS)
def list_files(
    s: SessionDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> FilePage:
    """Newest first; ``after``: the last file id of the previous page (OpenAI's cursor)."""
    return svc.list_files(s, tenant, limit, after)


@router.get("/{file_id}", response_model=FileOut, responses=ERRORS)
def get_file(f: FileDep) -> FileOut:
    return svc.file_out(f)


@router.get("/{file_id}/content", responses={200: {"content": {"application/jsonl": {}, "text/csv": {}}}, **ERRORS})
def file_content(f: FileDep, objects: ObjectsDep) -> StreamingResponse:
    """A dataset's JSONL, or a job's metrics CSV (purpose fine-tune-results)."""
    csv = f.purpose == "fine-tune-results"
    return StreamingResponse(
        svc.open_content(objects, f.object_key),
        media_type="text/csv" if csv else "application/jsonl",
        headers={"Content-Disposition": f'attachment; filename="{f.id}.{"csv" if csv else "jsonl"}"'},
    )


@router.delete("/{file_id}", status_code=204, responses={**error_responses(409), **ERRORS})
def delete_file(f: FileDep, s: SessionDep, db: DatabaseDep, objects: ObjectsDep) -> Response:
    """409 while a queued or running job uses it; jobs that finished keep `training_file: null`."""
    deletion.delete_file(s, f, db, objects)
    return Response(status_code=204)  # no content type: OpenAI's SDK then reads no JSON from it
