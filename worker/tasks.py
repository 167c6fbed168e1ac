"""Celery tasks: thin, taking ids only; the work is in worker.runner and worker.reaper."""

from __future__ import annotations

from celery import shared_task

# Imported here, by the worker's main process at start-up, so that every job process its pool forks has the
# runner's modules (SQLAlchemy's ORM, the store, gspo_core's specs and graders: ~1.2 CPU seconds) already:
# a fresh process runs each job, and imported at the task's call they were paid inside every job's queue wait
# (docs/bench.md). Nothing of it imports torch, which still loads only once a job is claimed (worker.runner).
from worker.runner import run_job as _run_job


@shared_task(name="worker.tasks.run_job", acks_late=True)
def run_job(job_id: str) -> str:
    return _run_job(job_id)


@shared_task(name="worker.tasks.reap")
def reap() -> dict:
    from store.settings import get_settings
    from worker.reaper import reap_once

    requeued, failed = reap_once(get_settings())
    return {"requeued": requeued, "failed": failed}
