"""A running job's progress records: each step's metrics and samples, its held-out evaluations and checkpoints
(idempotent per step, so a resumed attempt rewrites rather than duplicates)."""

from __future__ import annotations

from sqlalchemy import Table, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.jobs import add_event
from store.models import Checkpoint, Job, Sample, StepMetric, utcnow


def _upsert(s: Session, table: Table, values: dict, keys: list[str], update_cols: list[str]) -> None:
    dialect = s.get_bind().dialect.name
    ins = (pg_insert if dialect == "postgresql" else sqlite_insert)(table).values(**values)
    s.execute(ins.on_conflict_do_update(index_elements=keys, set_={c: ins.excluded[c] for c in update_cols}))


def record_step(s: Session, job_id: str, step: int, metrics: dict) -> None:
    """Store a step's metrics (idempotent on (job, step): a resumed job rewrites, never duplicates)."""
    _upsert(
        s,
        StepMetric.__table__,
        {"job_id": job_id, "step": step, "metrics": metrics, "created_at": utcnow()},
        ["job_id", "step"],
        ["metrics"],
    )
    s.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(step=step, latest_metrics=metrics)
        .execution_options(synchronize_session=False)
    )


def record_evaluation(s: Session, job_id: str, evaluation: dict) -> None:
    """Keep a held-out evaluation (``evaluation["when"]``: before or after) on the job, beside the other."""
    job = s.get(Job, job_id, populate_existing=True)
    assert job is not None, "the worker holds the job's lease: its row exists"
    job.evaluation = {**(job.evaluation or {}), evaluation["when"]: evaluation}


def record_samples(s: Session, job_id: str, step: int, rows: list[dict]) -> None:
    _upsert(s, Sample.__table__, {"job_id": job_id, "step": step, "rows": rows}, ["job_id", "step"], ["rows"])


def record_checkpoint(s: Session, job: Job, step: int, prefix: str, size: int, final: bool) -> Checkpoint:
    """A checkpoint row with the metrics of its step (idempotent on (job, step))."""
    metrics = s.scalar(select(StepMetric.metrics).where(StepMetric.job_id == job.id, StepMetric.step == step)) or {}
    ckpt = s.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step))
    if ckpt is None:
        ckpt = Checkpoint(job_id=job.id, tenant_id=job.tenant_id, step=step)
        s.add(ckpt)
    ckpt.object_prefix, ckpt.size_bytes, ckpt.metrics, ckpt.final = prefix, size, metrics, final
    s.flush()
    add_event(s, job.id, "checkpoint", f"checkpoint at step {step}", {"checkpoint_id": ckpt.id, "step": step})
    return ckpt


def latest_checkpoint(s: Session, job_id: str) -> Checkpoint | None:
    return s.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()).limit(1))
