"""A job's step metrics (JSON or CSV), its live event stream (SSE) and its stored rollouts."""

from __future__ import annotations

import csv
import io
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import TypeAdapter
from sqlalchemy import select

from api.deps import JobDep, SessionDep, SettingsDep, StreamSlotDep
from api.errors import ApiError
from api.schemas import ErrorBody, Page, SamplesOut, StepMetricsOut, json_response
from api.services.events import parse_last_event_id, stream
from store.models import Sample, StepMetric

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["metrics"])
METRICS_PAGE = TypeAdapter(Page[StepMetricsOut])
ERRORS = {401: {"model": ErrorBody}, 404: {"model": ErrorBody}}
#: No job has more steps (GSPOConfig.steps <= 1e6); larger numbers are a 422 naming the parameter, not a
#: database overflow (SQLite integers stop at 2**63).
MAX_STEP = 1_000_000


def _csv(rows) -> str:
    keys = sorted({k for r in rows for k in r.metrics})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["step", *keys])
    for r in rows:
        w.writerow([r.step, *(r.metrics.get(k, "") for k in keys)])
    return buf.getvalue()


@router.get("/metrics", response_model=Page[StepMetricsOut], responses={200: {"content": {"text/csv": {}}}, **ERRORS})
def get_metrics(
    job: JobDep,
    s: SessionDep,
    after_step: Annotated[int, Query(ge=0, le=MAX_STEP)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    format: Literal["json", "csv"] = "json",
):
    # Plain rows, not ORM objects: a dashboard polls this with thousands of steps.
    rows = s.execute(
        select(StepMetric.step, StepMetric.metrics, StepMetric.created_at)
        .where(StepMetric.job_id == job.id, StepMetric.step > after_step)
        .order_by(StepMetric.step)
        .limit(limit)
    ).all()
    if format == "csv":
        return PlainTextResponse(_csv(rows), media_type="text/csv")
    return json_response(METRICS_PAGE.validate_python({"data": [r._asdict() for r in rows]}))


def _event_position(last_event_id: Annotated[str | None, Header(max_length=64)] = None) -> tuple[int, int]:
    return parse_last_event_id(last_event_id)


@router.get(
    "/events",
    responses={
        200: {"content": {"text/event-stream": {}}},
        400: {"model": ErrorBody},
        429: {"model": ErrorBody},
        **ERRORS,
    },
)
async def job_events(
    job: JobDep,
    request: Request,
    settings: SettingsDep,
    after: Annotated[tuple[int, int], Depends(_event_position)],
    _: StreamSlotDep,
):
    """Server-sent events: `status`, `log`, `checkpoint`, `metrics` (one per step), then `end`. A stream
    ends after GSPO_STREAM_MAX_SECONDS (reconnect with `Last-Event-ID`); a tenant has at most
    GSPO_MAX_STREAMS_PER_TENANT open (429)."""
    state = request.app.state
    return StreamingResponse(
        stream(state.db, state.stream_pool, job.id, after, settings.stream_poll_seconds, settings.stream_max_seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/samples", response_model=SamplesOut, responses=ERRORS)
def get_samples(job: JobDep, s: SessionDep, step: Annotated[int | None, Query(ge=1, le=MAX_STEP)] = None):
    """The stored rollouts of ``step`` (default: the latest): prompts, completions, rewards, grader errors."""
    steps = list(s.scalars(select(Sample.step).where(Sample.job_id == job.id).order_by(Sample.step)))
    if not steps:
        raise ApiError(404, "not_found", f"job {job.id} has no stored samples yet")
    want = step if step is not None else steps[-1]
    row = s.scalar(select(Sample).where(Sample.job_id == job.id, Sample.step == want))
    if row is None:
        raise ApiError(404, "not_found", f"no samples stored for step {want}", "step")
    return SamplesOut(step=want, rows=row.rows, steps_available=steps)
