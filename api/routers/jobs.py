"""/v1/jobs: create (validated, idempotent), list (cursor), get, its environment, cancel, pause, resume, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from api.bodies import StrictJsonRoute
from api.deps import DatabaseDep, JobDep, ObjectsDep, SessionDep, SettingsDep, TenantDep
from api.job_schemas import EnvironmentOut, JobCreate, JobOut, JobStatus
from api.schemas import Page, error_responses, json_response
from api.services import deletion, environments
from api.services import jobs as svc

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=StrictJsonRoute)
ERRORS = error_responses(400, 401, 404, 422, 429)


@router.post(
    "",
    response_model=JobOut,
    status_code=201,
    responses={
        200: {"model": JobOut, "description": "The job an earlier request with this Idempotency-Key created."},
        **ERRORS,
        **error_responses(503),
    },
)
def create_job(
    req: JobCreate,
    s: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    response: Response,
    objects: ObjectsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobOut:
    job, created = svc.create_job(s, settings, tenant, req, idempotency_key, objects)
    if not created:
        response.status_code = 200
    return job


@router.get("", response_model=Page[JobOut], responses=ERRORS)
def list_jobs(
    s: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> Page[JobOut]:
    return svc.list_jobs(s, settings, tenant, status, limit, cursor)


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS)
def get_job(job: JobDep, s: SessionDep, settings: SettingsDep) -> Response:
    return json_response(svc.to_out(s, settings, job))


@router.get("/{job_id}/environment", response_model=EnvironmentOut, responses={**ERRORS, **error_responses(503)})
def get_environment(
    job: JobDep, settings: SettingsDep, samples: Annotated[int, Query(ge=0, le=20)] = 3
) -> EnvironmentOut:
    """The job's environment and its first training items (404 for a job trained on files; 422 naming `samples`
    when they do not generate within GSPO_ENVIRONMENT_CHECK_TIMEOUT_S)."""
    return environments.environment_out(job, samples, settings)


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS)
def cancel_job(job: JobDep, s: SessionDep, settings: SettingsDep, objects: ObjectsDep) -> JobOut:
    return svc.cancel_job(s, settings, objects, job)


@router.post("/{job_id}/pause", response_model=JobOut, responses={**error_responses(409), **ERRORS})
def pause_job(job: JobDep, s: SessionDep, settings: SettingsDep) -> JobOut:
    """A queued job is paused at once; a running one is ``pausing`` until it checkpointed at its next step
    and stopped (then ``paused``); 409 naming its status when it has finished or is cancelling."""
    return svc.pause_job(s, settings, job)


@router.post("/{job_id}/resume", response_model=JobOut, responses={**error_responses(409), **ERRORS})
def resume_job(job: JobDep, s: SessionDep, settings: SettingsDep) -> JobOut:
    """A paused job is queued again and continues from its latest checkpoint (429 at the tenant's cap of
    active jobs); a pausing one runs on; 409 naming its status when it has finished or is cancelling."""
    return svc.resume_job(s, settings, job)


@router.delete("/{job_id}", status_code=204, responses={**error_responses(409), **ERRORS})
def delete_job(job: JobDep, s: SessionDep, db: DatabaseDep, objects: ObjectsDep) -> None:
    """A finished job (succeeded, failed, cancelled) with its metrics, samples, events and checkpoints;
    409 naming its status while it is queued or running."""
    deletion.delete_job(s, job, db, objects)
