"""A job's step metrics (a page or CSV) and its stored rollouts."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.job_schemas import SamplesOut, StepMetricsOut
from api.schemas import Page
from store.models import Job, Sample, StepMetric

METRICS_PAGE = TypeAdapter(Page[StepMetricsOut])


def _rows(s: Session, job: Job, after_step: int, limit: int) -> Sequence[Row[tuple[int, dict[str, Any], Any]]]:
    # Plain rows, not ORM objects: a dashboard polls this with thousands of steps.
    return s.execute(
        select(StepMetric.step, StepMetric.metrics, StepMetric.created_at)
        .where(StepMetric.job_id == job.id, StepMetric.step > after_step)
        .order_by(StepMetric.step)
        .limit(limit)
    ).all()


def metrics_page(s: Session, job: Job, after_step: int, limit: int) -> Page[StepMetricsOut]:
    """Up to ``limit`` steps after ``after_step``, in step order."""
    return METRICS_PAGE.validate_python({"data": [r._asdict() for r in _rows(s, job, after_step, limit)]})


def metrics_csv(s: Session, job: Job, after_step: int, limit: int) -> str:
    """The same steps as CSV: a ``step`` column, then one column per metric name (sorted)."""
    rows = _rows(s, job, after_step, limit)
    keys = sorted({k for r in rows for k in r.metrics})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["step", *keys])
    for r in rows:
        w.writerow([r.step, *(r.metrics.get(k, "") for k in keys)])
    return buf.getvalue()


def samples(s: Session, job: Job, step: int | None) -> SamplesOut:
    """The stored rollouts of ``step`` (default: the latest); 404 naming ``step`` when none are stored."""
    steps = list(s.scalars(select(Sample.step).where(Sample.job_id == job.id).order_by(Sample.step)))
    if not steps:
        raise ApiError(404, "not_found", f"job {job.id} has no stored samples yet")
    want = step if step is not None else steps[-1]
    row = s.scalar(select(Sample).where(Sample.job_id == job.id, Sample.step == want))
    if row is None:
        raise ApiError(404, "not_found", f"no samples stored for step {want}", "step")
    return SamplesOut(step=want, rows=row.rows, steps_available=steps)
