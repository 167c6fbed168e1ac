"""Requeues jobs whose worker lease went stale; fails those past their retry budget."""

from __future__ import annotations

import logging
import threading

from store import jobs
from store.queue import enqueue_run_job
from store.settings import Settings
from worker.context import get_db

log = logging.getLogger(__name__)


def reap_once(settings: Settings) -> tuple[list[str], list[str]]:
    with get_db(settings).session() as s:
        requeued, failed = jobs.reap(s)
    for job_id in requeued:
        enqueue_run_job(settings, job_id)
    if requeued or failed:
        log.warning("reaper: requeued %s, failed %s", requeued, failed)
    return requeued, failed


def start_reaper_thread(settings: Settings, stop: threading.Event | None = None) -> threading.Thread:
    """Every live worker also reaps (the 'beat' of the embedded and small deployments)."""
    stop = stop or threading.Event()

    def loop() -> None:
        while not stop.wait(settings.reaper_interval_seconds):
            try:
                reap_once(settings)
            except Exception as exc:  # database down: try again next round
                log.warning("reaper: %s", exc)

    th = threading.Thread(target=loop, name="gspo-reaper", daemon=True)
    th.start()
    return th
