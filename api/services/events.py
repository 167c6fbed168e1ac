"""Server-sent events of a job: status changes, log lines and each new step's metrics.

The event id is ``<last job_event id>.<last step>`` (step -1 before any: step 0 is the evaluation before
training), so ``Last-Event-ID`` resumes both streams. A stream
holds no database connection between polls (each poll is a short session on a small thread pool of
its own) and ends after ``max_s``; the client's EventSource reconnects with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from sqlalchemy import select

from api.errors import ApiError
from api.schemas import as_utc
from store.db import Database
from store.jobs import TERMINAL
from store.models import Job, JobEvent, StepMetric

_EVENT_ID = re.compile(r"(\d{1,18})\.(-1|\d{1,18})")


def parse_last_event_id(value: str | None) -> tuple[int, int]:
    """``(event id, step)`` of a ``Last-Event-ID`` this API sent; 400 naming the header otherwise."""
    if not value:
        return 0, -1
    match = _EVENT_ID.fullmatch(value.strip())
    if match is None:
        raise ApiError(
            400,
            "invalid_header",
            "Last-Event-ID must be an id this stream sent (<event>.<step>, each at most 18 digits)",
            "Last-Event-ID",
        )
    return int(match[1]), int(match[2])


def _poll(
    db: Database, job_id: str, ev_after: int, step_after: int
) -> tuple[list[JobEvent], list[StepMetric], str, int]:
    s = db.read_session()
    try:
        events = list(
            s.scalars(
                select(JobEvent)
                .where(JobEvent.job_id == job_id, JobEvent.id > ev_after)
                .order_by(JobEvent.id)
                .limit(500)
            )
        )
        metrics = list(
            s.scalars(
                select(StepMetric)
                .where(StepMetric.job_id == job_id, StepMetric.step > step_after)
                .order_by(StepMetric.step)
                .limit(500)
            )
        )
        job = s.execute(select(Job.status, Job.step).where(Job.id == job_id)).one_or_none()
    finally:
        s.close()
    status, step = job if job is not None else ("deleted", 0)
    return events, metrics, status, step


def _frame(event: str, ident: str, data: dict[str, Any]) -> str:
    return f"id: {ident}\nevent: {event}\ndata: {json.dumps(data, default=str)}\n\n"


async def stream(
    db: Database, pool: Executor, job_id: str, after: tuple[int, int], poll_s: float = 0.5, max_s: float = 900.0
) -> AsyncIterator[str]:
    """Yield SSE frames until the job is terminal and drained (or ``max_s`` passes)."""
    ev_after, step_after = after
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    yield "retry: 2000\n\n"
    while loop.time() < deadline:
        events, metrics, status, step = await loop.run_in_executor(pool, _poll, db, job_id, ev_after, step_after)
        for m in metrics:
            step_after = m.step
            yield _frame("metrics", f"{ev_after}.{step_after}", {"step": m.step, "metrics": m.metrics})
        for e in events:
            ev_after = e.id
            yield _frame(
                e.kind,
                f"{ev_after}.{step_after}",
                {
                    "id": e.id,
                    "kind": e.kind,
                    "message": e.message,
                    "data": e.data,
                    "created_at": as_utc(e.created_at).isoformat(),
                },
            )
        if (status in TERMINAL or status == "deleted") and not events and not metrics:
            yield _frame("end", f"{ev_after}.{step_after}", {"status": status, "step": step})
            return
        if not events and not metrics:
            yield ": keep-alive\n\n"
            await asyncio.sleep(poll_s)
