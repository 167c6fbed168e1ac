"""Deleting a tenant's data: jobs (with everything they produced, webhook deliveries too), checkpoints, files.

Rows go first, in one transaction (committed here) that also records their objects' prefixes as
pending deletions; the objects go after the commit, and then the record. A failure in between leaves objects that no
row points to (never readable through the API, never a row without its content), and the record
makes the next ``purge`` (each deletion, and every API start) remove them.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from api.errors import ApiError, not_found
from store.db import Database
from store.jobs import ACTIVE
from store.models import Checkpoint, File, Job, JobEvent, PendingDeletion, Sample, StepMetric, WebhookDelivery
from store.objects import ObjectStore

log = logging.getLogger(__name__)
Row = TypeVar("Row", Job, File, Checkpoint)


def _active_job_on(s: Session, tenant_id: str, checkpoint_ids: list[str]) -> tuple[str, str] | None:
    """``(job id, checkpoint id)`` of an active job that trains from one of these checkpoints."""
    if not checkpoint_ids:
        return None
    row = s.execute(
        select(Job.id, Job.model)
        .where(Job.tenant_id == tenant_id, Job.status.in_(ACTIVE), Job.model.in_([f"ckpt:{c}" for c in checkpoint_ids]))
        .limit(1)
    ).first()
    return (row.id, row.model[5:]) if row else None


def _locked(s: Session, model: type[Row], row_id: str, kind: str) -> Row:
    """The row again, locked until commit on PostgreSQL (SQLite's writer lock serializes the rest);
    404 when a concurrent deletion removed it first."""
    row = s.scalar(select(model).where(model.id == row_id).with_for_update().execution_options(populate_existing=True))
    if row is None:
        raise not_found(kind, row_id)
    return row


def _delete_job_rows(s: Session, job: Job) -> None:
    """A finished job and everything it produced; 409 naming the status while it is active."""
    job = _locked(s, Job, job.id, "job")
    if job.status in ACTIVE:
        raise ApiError(
            409, "job_active", f"job {job.id} is {job.status}; cancel it and delete it once it has stopped", "job_id"
        )
    checkpoints = list(s.scalars(select(Checkpoint.id).where(Checkpoint.job_id == job.id)))
    if user := _active_job_on(s, job.tenant_id, checkpoints):
        raise ApiError(
            409,
            "checkpoint_in_use",
            f"job {user[0]} trains from this job's checkpoint {user[1]}; delete this job once it has finished",
            "job_id",
        )
    for table in (JobEvent, StepMetric, Sample, Checkpoint, WebhookDelivery):
        s.execute(delete(table).where(table.job_id == job.id))
    s.execute(delete(Job).where(Job.id == job.id))
    s.add(PendingDeletion(prefix=f"jobs/{job.id}"))  # every checkpoint and any upload a lost attempt left
    s.commit()


def _delete_checkpoint_rows(s: Session, ckpt: Checkpoint) -> None:
    """A checkpoint and its stored files; 409 while its job runs (it resumes from its checkpoints) or
    while an active job trains from it (``model: ckpt:<id>``). Finished jobs that started from it keep
    their ``model`` as a record; new jobs naming it get a 404."""
    ckpt = _locked(s, Checkpoint, ckpt.id, "checkpoint")
    status = s.scalar(select(Job.status).where(Job.id == ckpt.job_id))
    if status in ACTIVE:
        raise ApiError(
            409,
            "checkpoint_in_use",
            f"job {ckpt.job_id} is {status} and may resume from this checkpoint; delete it once the job has stopped",
            "checkpoint_id",
        )
    if user := _active_job_on(s, ckpt.tenant_id, [ckpt.id]):
        raise ApiError(409, "checkpoint_in_use", f"job {user[0]} trains from checkpoint {ckpt.id}", "checkpoint_id")
    s.execute(delete(Checkpoint).where(Checkpoint.id == ckpt.id))
    s.add(PendingDeletion(prefix=ckpt.object_prefix))
    s.commit()


def _delete_file_rows(s: Session, f: File) -> None:
    """A file and its content; 409 while an active job uses it. Finished jobs keep their history with
    the file's id set to null."""
    f = _locked(s, File, f.id, "file")
    used = s.execute(
        select(Job.id, Job.status)
        .where((Job.training_file_id == f.id) | (Job.validation_file_id == f.id), Job.status.in_(ACTIVE))
        .limit(1)
    ).first()
    if used:
        raise ApiError(
            409,
            "file_in_use",
            f"file {f.id} is used by job {used.id} ({used.status}); delete it once the job has finished",
            "file_id",
        )
    s.execute(delete(File).where(File.id == f.id))
    s.add(PendingDeletion(prefix=f.object_key))
    s.commit()


def delete_job(s: Session, job: Job, db: Database, objects: ObjectStore) -> None:
    """A finished job and everything it produced; 409 naming the status while it is active."""
    _delete_job_rows(s, job)
    purge(db, objects)


def delete_checkpoint(s: Session, ckpt: Checkpoint, db: Database, objects: ObjectStore) -> None:
    """A checkpoint and its stored files; 409 while its job is active or an active job trains from it."""
    _delete_checkpoint_rows(s, ckpt)
    purge(db, objects)


def delete_file(s: Session, f: File, db: Database, objects: ObjectStore) -> None:
    """A file and its content; 409 while an active job uses it."""
    _delete_file_rows(s, f)
    purge(db, objects)


def purge(db: Database, objects: ObjectStore, limit: int = 50) -> int:
    """Remove the objects of up to ``limit`` pending deletions, oldest first, and checkpoint SQLite's WAL (the
    deleted rows leave the disk); returns how many went. Deleting an object twice is harmless, so
    concurrent purges need no coordination."""
    with db.session() as s:
        pending = s.execute(
            select(PendingDeletion.id, PendingDeletion.prefix).order_by(PendingDeletion.id).limit(limit)
        ).all()
    done = 0
    for pid, prefix in pending:
        try:
            objects.delete_prefix(prefix)
        except Exception as exc:  # kept for the next purge
            log.warning("could not delete stored objects under %s: %s", prefix, exc)
            continue
        with db.session() as s:
            s.execute(delete(PendingDeletion).where(PendingDeletion.id == pid))
        done += 1
    if not db.checkpoint_wal():
        log.info("SQLite's WAL is still read by an older snapshot: the next deletion checkpoints it")
    return done
