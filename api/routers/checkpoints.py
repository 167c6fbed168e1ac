"""Checkpoints: list a job's, download one as a streamed .tar.gz (or a presigned redirect), delete one."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, StreamingResponse
from sqlalchemy import select

from api.deps import CheckpointDep, JobDep, ObjectsDep, SessionDep
from api.errors import ApiError
from api.schemas import CheckpointOut, ErrorBody, Page
from api.services.archive import archive_members, stream_tar_gz
from api.services.deletion import delete_checkpoint as delete_checkpoint_rows
from api.services.deletion import purge
from store.models import Checkpoint
from store.objects import ARCHIVE_NAME

router = APIRouter(tags=["checkpoints"])
ERRORS = {401: {"model": ErrorBody}, 404: {"model": ErrorBody}}


def _out(c: Checkpoint, request: Request) -> CheckpointOut:
    return CheckpointOut(
        id=c.id,
        job_id=c.job_id,
        step=c.step,
        size_bytes=c.size_bytes,
        final=c.final,
        metrics={k: float(v) for k, v in (c.metrics or {}).items()},
        created_at=c.created_at,
        download_url=str(request.url_for("download_checkpoint", checkpoint_id=c.id)),
    )


@router.get("/v1/jobs/{job_id}/checkpoints", response_model=Page[CheckpointOut], responses=ERRORS)
def list_checkpoints(job: JobDep, s: SessionDep, request: Request):
    rows = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step))
    return Page[CheckpointOut](data=[_out(c, request) for c in rows])


@router.get("/v1/checkpoints/{checkpoint_id}", response_model=CheckpointOut, responses=ERRORS)
def get_checkpoint(c: CheckpointDep, request: Request):
    return _out(c, request)


@router.get(
    "/v1/checkpoints/{checkpoint_id}/download",
    name="download_checkpoint",
    responses={200: {"content": {"application/gzip": {}}}, 307: {"description": "presigned URL"}, **ERRORS},
)
def download_checkpoint(c: CheckpointDep, objects: ObjectsDep):
    """The checkpoint's Hugging Face directory (``model/``, plus ``adapter/`` for LoRA) as .tar.gz:
    a redirect to a presigned URL of the archive the worker stored (S3), else streamed on the fly."""
    members = archive_members(objects, c.object_prefix)
    if not members:
        raise ApiError(404, "not_found", f"checkpoint {c.id} has no stored files")
    archive_key = f"{c.object_prefix}/{ARCHIVE_NAME}"
    if any(k == archive_key for k, _ in objects.list(c.object_prefix)):
        if url := objects.presigned_url(archive_key):
            return RedirectResponse(url, status_code=307)
    root = f"{c.job_id}-step-{c.step:06d}"
    return StreamingResponse(
        stream_tar_gz(objects, members, root),
        media_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="{root}.tar.gz"',
            "X-Checkpoint-Bytes": str(sum(size for _, _, size in members)),
        },
    )


@router.delete("/v1/checkpoints/{checkpoint_id}", status_code=204, responses={409: {"model": ErrorBody}, **ERRORS})
def delete_checkpoint(c: CheckpointDep, s: SessionDep, request: Request):
    """409 while its job is queued or running, or while an active job trains from it (`ckpt:<id>`)."""
    delete_checkpoint_rows(s, c)
    purge(request.app.state.db, request.app.state.objects)
