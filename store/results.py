"""A finished job's results file: its step metrics as CSV, a file of its tenant (purpose fine-tune-results)."""

from __future__ import annotations

import csv
import io
import logging
from datetime import timedelta

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from store.jobs import TERMINAL
from store.models import File, Job, StepMetric, utcnow
from store.objects import ObjectStore

log = logging.getLogger(__name__)

PURPOSE = "fine-tune-results"
FILENAME = "step_metrics.csv"
# OpenAI's reinforcement fine-tuning names, derived from our metric keys; the raw keys follow them.
DERIVED = (("train_mean_reward", "reward/mean"), ("full_valid_mean_reward", "eval/reward/mean"))


def metrics_csv(s: Session, job_id: str) -> tuple[bytes, int]:
    """``(CSV, rows)``: a ``step`` column, OpenAI's names (`DERIVED`), then every metric key (sorted)."""
    rows = s.execute(
        select(StepMetric.step, StepMetric.metrics).where(StepMetric.job_id == job_id).order_by(StepMetric.step)
    ).all()
    lead = ["step", *(name for name, _ in DERIVED)]
    keys = sorted({k for r in rows for k in r.metrics} - set(lead))  # the trainer's own "step" is the step
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*lead, *keys])
    for step, metrics in rows:
        w.writerow([step, *(metrics.get(key, "") for _, key in DERIVED), *(metrics.get(k, "") for k in keys)])
    return buf.getvalue().encode(), len(rows)


def result_file_ids(s: Session, job_id: str) -> list[str]:
    return list(s.scalars(select(File.id).where(File.job_id == job_id)))


def attach(s: Session, objects: ObjectStore, job: Job, settling: bool = False) -> File | None:
    """Write the ended ``job``'s metrics CSV and its file row, once: a second call (the reaper's sweep) finds
    the row; a retried transaction rewrites the same object key. Counted in the tenant's storage quota, never
    refused by it (the job has run). None while the job has not ended.

    ``settling``: in the transaction that ends the job, so that no reader sees it ended without its results
    file; an object store that fails then leaves the outcome alone (logged, None: the reaper's sweep writes it)."""
    if job.status not in TERMINAL:
        return None
    found = s.scalar(select(File).where(File.job_id == job.id))
    if found is not None:
        return found
    data, rows = metrics_csv(s, job.id)
    key = f"tenants/{job.tenant_id}/files/results-{job.id}.csv"
    try:
        objects.put_bytes(key, data)
    except Exception as exc:
        if not settling:
            raise
        log.warning(
            "results file of job %s not written now (%s: %s); the reaper writes it", job.id, type(exc).__name__, exc
        )
        return None
    f = File(
        tenant_id=job.tenant_id,
        filename=FILENAME,
        bytes=len(data),
        rows=rows,
        object_key=key,
        item_fields=[],
        purpose=PURPOSE,
        job_id=job.id,
    )
    s.add(f)
    s.flush()
    return f


def attach_committed(s: Session, objects: ObjectStore, job_id: str) -> File | None:
    """`attach` in its own transaction, after the one that ended the job committed: an object store or
    database failure here leaves the job's outcome alone (logged; the reaper's sweep writes it later), and
    of two concurrent writers the unique index keeps one row."""
    try:
        job = s.get(Job, job_id, populate_existing=True)
        f = attach(s, objects, job) if job is not None else None
        s.commit()
        return f
    except Exception as exc:
        s.rollback()
        log.warning(
            "results file of job %s not written now (%s: %s); the reaper tries again", job_id, type(exc).__name__, exc
        )
        return None


def jobs_without_results(s: Session, within_s: float = 86400.0, limit: int = 50) -> list[str]:
    """Jobs that ended in the last ``within_s`` seconds without a results file (ended by the reaper, or
    whose settle could not write it): the reaper attaches theirs."""
    q = (
        select(Job.id)
        .where(
            Job.status.in_(TERMINAL),
            Job.finished_at > utcnow() - timedelta(seconds=within_s),
            ~exists().where(File.job_id == Job.id),
        )
        .limit(limit)
    )
    return list(s.scalars(q))
