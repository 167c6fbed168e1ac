"""Checkpoints: list a job's, download one as a streamed .tar.gz (or a presigned redirect), delete one."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse, StreamingResponse

from api.deps import CheckpointDep, DatabaseDep, JobDep, ObjectsDep, SessionDep
from api.job_schemas import CheckpointOut
from api.schemas import Page, error_responses
from api.services import checkpoints as svc
from api.services import deletion

router = APIRouter(tags=["checkpoints"])
ERRORS = error_responses(401, 404)


def _download_url(request: Request) -> svc.DownloadUrl:
    return lambda checkpoint_id: str(request.url_for("download_checkpoint", checkpoint_id=checkpoint_id))


@router.get("/v1/jobs/{job_id}/checkpoints", response_model=Page[CheckpointOut], responses=ERRORS)
def list_checkpoints(job: JobDep, s: SessionDep, request: Request) -> Page[CheckpointOut]:
    return svc.list_checkpoints(s, job, _download_url(request))


@router.get("/v1/checkpoints/{checkpoint_id}", response_model=CheckpointOut, responses=ERRORS)
def get_checkpoint(c: CheckpointDep, request: Request) -> CheckpointOut:
    return svc.checkpoint_out(c, _download_url(request))


@router.get(
    "/v1/checkpoints/{checkpoint_id}/download",
    name="download_checkpoint",
    responses={200: {"content": {"application/gzip": {}}}, 307: {"description": "presigned URL"}, **ERRORS},
)
def download_checkpoint(c: CheckpointDep, objects: ObjectsDep) -> Response:
    """The checkpoint's Hugging Face directory (``model/``, plus ``adapter/`` for LoRA) as .tar.gz:
    a redirect to a presigned URL of the archive the worker stored (S3), else streamed on the fly."""
    archive = svc.download(objects, c)
    if isinstance(archive, str):
        return RedirectResponse(archive, status_code=307)
    return StreamingResponse(
        archive.chunks,
        media_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="{archive.filename}"',
            "X-Checkpoint-Bytes": str(archive.size_bytes),
        },
    )


@router.delete("/v1/checkpoints/{checkpoint_id}", status_code=204, responses=error_responses(409, 401, 404))
def delete_checkpoint(c: CheckpointDep, s: SessionDep, db: DatabaseDep, objects: ObjectsDep) -> None:
    """409 while its job is queued or running, or while an active job trains from it (`ckpt:<id>`)."""
    deletion.delete_checkpoint(s, c, db, objects)
