"""/v1/fine_tuning: OpenAI's fine-tuning API (jobs, events, checkpoints, graders) over this service's jobs,
so the official `openai` SDK drives it (docs/openai.md). Errors in OpenAI's shape (api/errors.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from api.bodies import StrictJsonRoute
from api.deps import GradingPoolDep, JobDep, LimitsDep, ObjectsDep, SessionDep, SettingsDep, TenantDep
from api.openai_schemas import (
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCreate,
    FineTuningJobEvent,
    GraderRunIn,
    GraderRunOut,
    GraderValidateIn,
    GraderValidateOut,
    ListOut,
    openai_errors,
)
from api.services import openai_events as events
from api.services import openai_graders as graders
from api.services import openai_jobs as svc

router = APIRouter(prefix="/v1/fine_tuning", tags=["openai fine-tuning"], route_class=StrictJsonRoute)
ERRORS = openai_errors(400, 401, 404, 429, 503)
Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, Query(max_length=64)]


@router.post("/jobs", response_model=FineTuningJob, responses=ERRORS)
def create_job(
    req: FineTuningJobCreate, s: SessionDep, settings: SettingsDep, objects: ObjectsDep, tenant: TenantDep
) -> FineTuningJob:
    """``method.type`` reinforcement (run with GSPO) or supervised; dpo is a 400 naming ``method.type``."""
    return svc.create(s, settings, objects, tenant, req)


@router.get("/jobs", response_model=ListOut[FineTuningJob], responses=ERRORS)
def list_jobs(
    request: Request, s: SessionDep, tenant: TenantDep, after: After = None, limit: Limit = 20
) -> ListOut[FineTuningJob]:
    """Newest first; ``metadata[key]=value`` query parameters keep the jobs whose metadata holds them all."""
    metadata = {k[9:-1]: v for k, v in request.query_params.items() if k.startswith("metadata[") and k.endswith("]")}
    return svc.list_jobs(s, tenant, after, limit, metadata)


@router.get("/jobs/{job_id}", response_model=FineTuningJob, responses=ERRORS)
def retrieve_job(job: JobDep, s: SessionDep) -> FineTuningJob:
    return svc.job_object(s, job)


@router.post("/jobs/{job_id}/cancel", response_model=FineTuningJob, responses=ERRORS)
def cancel_job(job: JobDep, s: SessionDep, settings: SettingsDep, objects: ObjectsDep) -> FineTuningJob:
    return svc.cancel(s, settings, objects, job)


@router.post("/jobs/{job_id}/pause", response_model=FineTuningJob, responses=ERRORS)
def pause_job(job: JobDep, s: SessionDep, settings: SettingsDep) -> FineTuningJob:
    """A queued job pauses at once; a running one checkpoints at its next step and stops (``paused``, with
    ``gspo_status`` pausing until then); 400 when it has finished."""
    return svc.pause(s, settings, job)


@router.post("/jobs/{job_id}/resume", response_model=FineTuningJob, responses=ERRORS)
def resume_job(job: JobDep, s: SessionDep, settings: SettingsDep) -> FineTuningJob:
    """A paused job is queued again and continues from its latest checkpoint (429 at the tenant's cap)."""
    return svc.resume(s, settings, job)


@router.get("/jobs/{job_id}/events", response_model=ListOut[FineTuningJobEvent], responses=ERRORS)
def list_events(job: JobDep, s: SessionDep, after: After = None, limit: Limit = 20) -> ListOut[FineTuningJobEvent]:
    """Newest first: status and log lines (``message``), each step's metrics (``metrics``)."""
    return events.list_events(s, job, after, limit)


@router.get("/jobs/{job_id}/checkpoints", response_model=ListOut[FineTuningJobCheckpoint], responses=ERRORS)
def list_checkpoints(
    job: JobDep, s: SessionDep, request: Request, after: After = None, limit: Limit = 10
) -> ListOut[FineTuningJobCheckpoint]:
    """Newest first; ``fine_tuned_model_checkpoint`` (``ckpt:<id>``) is a ``model`` a new job starts from."""
    url = lambda cid: str(request.url_for("download_checkpoint", checkpoint_id=cid))  # noqa: E731
    return events.list_checkpoints(s, job, after, limit, url)


@router.post("/alpha/graders/run", response_model=GraderRunOut, responses=ERRORS)
async def run_grader(
    req: GraderRunIn, tenant: TenantDep, settings: SettingsDep, limits: LimitsDep, pool: GradingPoolDep
) -> GraderRunOut:
    """The dry run of POST /v1/rewards/run on one sample, within the same per-tenant bounds."""
    return await graders.run(limits, pool, settings, tenant.id, req)


@router.post("/alpha/graders/validate", response_model=GraderValidateOut, responses=ERRORS)
async def validate_grader(req: GraderValidateIn, tenant: TenantDep, settings: SettingsDep) -> GraderValidateOut:
    return await graders.validate(settings, req)
