"""/v1/files: upload (validated JSONL), list, get, content, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File as FormFile, Query, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.deps import FileDep, ObjectsDep, SessionDep, SettingsDep, TenantDep
from api.schemas import ErrorBody, FileOut, Page
from api.services import files as svc
from store.models import File

router = APIRouter(prefix="/v1/files", tags=["files"])
ERRORS = {400: {"model": ErrorBody}, 401: {"model": ErrorBody}, 404: {"model": ErrorBody},
          413: {"model": ErrorBody}, 422: {"model": ErrorBody}}


def _out(f: File) -> FileOut:
    return FileOut(id=f.id, filename=f.filename, bytes=f.bytes, rows=f.rows, item_fields=f.item_fields or [],
                   created_at=f.created_at)


@router.post("", response_model=FileOut, status_code=201, responses=ERRORS)
async def upload_file(s: SessionDep, objects: ObjectsDep, settings: SettingsDep, tenant: TenantDep,
                      file: Annotated[UploadFile, FormFile(description="JSONL: one object per line with `prompt` or `messages`")]):
    data = await svc.read_bounded(file, settings.max_upload_bytes)
    return _out(svc.create_file(s, objects, settings, tenant, file.filename or "data.jsonl", data))


@router.get("", response_model=Page[FileOut], responses=ERRORS)
def list_files(s: SessionDep, tenant: TenantDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    rows = s.scalars(select(File).where(File.tenant_id == tenant.id).order_by(File.created_at.desc()).limit(limit))
    return Page[FileOut](data=[_out(f) for f in rows])


@router.get("/{file_id}", response_model=FileOut, responses=ERRORS)
def get_file(f: FileDep):
    return _out(f)


@router.get("/{file_id}/content", responses={200: {"content": {"application/jsonl": {}}}, **ERRORS})
def file_content(f: FileDep, objects: ObjectsDep):
    return StreamingResponse(svc.open_content(objects, f.object_key), media_type="application/jsonl",
                             headers={"Content-Disposition": f'attachment; filename="{f.id}.jsonl"'})


@router.delete("/{file_id}", status_code=204, responses={409: {"model": ErrorBody}, **ERRORS})
def delete_file(f: FileDep, s: SessionDep, objects: ObjectsDep):
    svc.delete_file(s, objects, f)
