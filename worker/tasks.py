"""Celery tasks: thin, taking ids only; the work is in worker.runner and worker.reaper."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="worker.tasks.run_job", acks_late=True)
def run_job(job_id: str) -> str:
    from worker.runner import run_job as run

    return run(job_id)


@shared_task(name="worker.tasks.reap")
def reap() -> dict:
    from store.settings import get_settings
    from worker.reaper import reap_once

    requeued, failed = reap_once(get_settings())
    return {"requeued": requeued, "failed": failed}
