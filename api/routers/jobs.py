"""/v1/jobs: create (validated, idempotent), list (cursor), get, cancel, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from api.bodies import StrictJsonRoute
from api.deps import JobDep, SessionDep, SettingsDep, TenantDep
from api.schemas import ErrorBody, JobCreate, JobOut, JobStatus, Page, json_response
from api.services import jobs as svc
from api.services.deletion import delete_job as delete_job_rows
from api.services.deletion import purge
from store import jobs as job_state

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=StrictJsonRoute)
ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 422, 429)}


@router.post(
    "",
    response_model=JobOut,
    status_code=201,
    responses={
        200: {"model": JobOut, "description": "The job an earlier request with this Idempotency-Key created."},
        **ERRORS,
    },
)
def create_job(
    req: JobCreate,
    s: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
):
    job, created = svc.create_job(s, settings, tenant, req, idempotency_key)
    if not created:
        response.status_code = 200
    return svc.to_out(s, settings, job)


@router.get("", response_model=Page[JobOut], responses=ERRORS)
def list_jobs(
    s: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
):
    rows, nxt = svc.list_jobs(s, tenant, status, limit, cursor)
    queue = svc.queue_view(s, settings, tenant.id)
    return Page[JobOut](data=[svc.to_out(s, settings, j, queue) for j in rows], next_cursor=nxt)


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS)
def get_job(job: JobDep, s: SessionDep, settings: SettingsDep):
    return json_response(svc.to_out(s, settings, job))


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS)
def cancel_job(job: JobDep, s: SessionDep, settings: SettingsDep):
    job_state.request_cancel(s, job)
    return svc.to_out(s, settings, job)


@router.delete("/{job_id}", status_code=204, responses={409: {"model": ErrorBody}, **ERRORS})
def delete_job(job: JobDep, s: SessionDep, request: Request):
    """A finished job (succeeded, failed, cancelled) with its metrics, samples, events and checkpoints;
    409 naming its status while it is queued or running."""
    delete_job_rows(s, job)
    purge(request.app.state.db, request.app.state.objects)
