"""A job's step metrics (JSON or CSV), its live event stream (SSE) and its stored rollouts."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from fastapi.responses import PlainTextResponse, StreamingResponse

from api.deps import DatabaseDep, JobDep, LastEventDep, SessionDep, SettingsDep, StreamPoolDep, StreamSlotDep
from api.job_schemas import SamplesOut, StepMetricsOut
from api.schemas import Page, error_responses, json_response
from api.services import metrics as svc
from api.services.events import stream

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["metrics"])
ERRORS = error_responses(401, 404)
#: No job has more steps (GSPOConfig.steps <= 1e6); larger numbers are a 422 naming the parameter, not a
#: database overflow (SQLite integers stop at 2**63).
MAX_STEP = 1_000_000


@router.get("/metrics", response_model=Page[StepMetricsOut], responses={200: {"content": {"text/csv": {}}}, **ERRORS})
def get_metrics(
    job: JobDep,
    s: SessionDep,
    # -1: from the start, step 0 (the held-out evaluation before training) included.
    after_step: Annotated[int, Query(ge=-1, le=MAX_STEP)] = -1,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    format: Literal["json", "csv"] = "json",
) -> Response:
    if format == "csv":
        return PlainTextResponse(svc.metrics_csv(s, job, after_step, limit), media_type="text/csv")
    return json_response(svc.metrics_page(s, job, after_step, limit))


@router.get(
    "/events",
    responses={200: {"content": {"text/event-stream": {}}}, **error_responses(400, 429), **ERRORS},
)
async def job_events(
    job: JobDep,
    settings: SettingsDep,
    db: DatabaseDep,
    pool: StreamPoolDep,
    after: LastEventDep,
    _: StreamSlotDep,
) -> StreamingResponse:
    """Server-sent events: `status`, `log`, `checkpoint`, `metrics` (one per step), then `end`. A stream
    ends after GSPO_STREAM_MAX_SECONDS (reconnect with `Last-Event-ID`); a tenant has at most
    GSPO_MAX_STREAMS_PER_TENANT open (429)."""
    return StreamingResponse(
        stream(db, pool, job.id, after, settings.stream_poll_seconds, settings.stream_max_seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/samples", response_model=SamplesOut, responses=ERRORS)
def get_samples(job: JobDep, s: SessionDep, step: Annotated[int | None, Query(ge=1, le=MAX_STEP)] = None) -> SamplesOut:
    """The stored rollouts of ``step`` (default: the latest): prompts, completions, rewards, grader errors."""
    return svc.samples(s, job, step)
