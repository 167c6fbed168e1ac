"""Server-sent events of a job: status changes, log lines and each new step's metrics.

The event id is ``<last job_event id>.<last step>``, so ``Last-Event-ID`` resumes both streams.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from sqlalchemy import select

from api.schemas import as_utc
from store.jobs import TERMINAL
from store.models import Job, JobEvent, StepMetric


def parse_last_event_id(value: str | None) -> tuple[int, int]:
    try:
        ev, step = (value or "0.0").split(".", 1)
        return max(0, int(ev)), max(0, int(step))
    except ValueError:
        return 0, 0


def _poll(db, job_id: str, ev_after: int, step_after: int):
    with db.session() as s:
        events = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > ev_after)
                                .order_by(JobEvent.id).limit(500)))
        metrics = list(s.scalars(select(StepMetric).where(StepMetric.job_id == job_id, StepMetric.step > step_after)
                                 .order_by(StepMetric.step).limit(500)))
        job = s.get(Job, job_id)
        return events, metrics, job.status, job.step


def _frame(event: str, ident: str, data: dict) -> str:
    return f"id: {ident}\nevent: {event}\ndata: {json.dumps(data, default=str)}\n\n"


async def stream(db, job_id: str, last_event_id: str | None, poll_s: float = 0.5,
                 max_s: float = 3600.0) -> AsyncIterator[str]:
    """Yield SSE frames until the job is terminal and drained (or ``max_s`` passes)."""
    ev_after, step_after = parse_last_event_id(last_event_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    yield "retry: 2000\n\n"
    while loop.time() < deadline:
        events, metrics, status, step = await asyncio.to_thread(_poll, db, job_id, ev_after, step_after)
        for m in metrics:
            step_after = m.step
            yield _frame("metrics", f"{ev_after}.{step_after}", {"step": m.step, "metrics": m.metrics})
        for e in events:
            ev_after = e.id
            yield _frame(e.kind, f"{ev_after}.{step_after}",
                         {"id": e.id, "kind": e.kind, "message": e.message, "data": e.data,
                          "created_at": as_utc(e.created_at).isoformat()})
        if status in TERMINAL and not events and not metrics:
            yield _frame("end", f"{ev_after}.{step_after}", {"status": status, "step": step})
            return
        if not events and not metrics:
            yield ": keep-alive\n\n"
            await asyncio.sleep(poll_s)
