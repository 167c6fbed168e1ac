"""Requeues jobs whose worker lease went stale; fails those past their retry budget; writes missing results files."""

from __future__ import annotations

import logging
import threading
import time

from store import jobs, results
from store.queue import enqueue_run_job, queue_depth
from store.scheduling import jobs_needing_tokens
from store.settings import Settings
from store.usage import QueuePolicy
from worker.context import get_db, get_store

log = logging.getLogger(__name__)
_RESENT: dict[str, float] = {}  # job id -> when this process last sent it a token (time.monotonic)


def reap_once(settings: Settings) -> tuple[list[str], list[str]]:
    with get_db(settings).session() as s:
        requeued, failed = jobs.reap(s)
    attach_missing_results(settings)
    for job_id in requeued:
        enqueue_run_job(settings, job_id)
    if requeued or failed:
        log.warning("reaper: requeued %s, failed %s", requeued, failed)
    resent = resend_lost(settings)
    if resent:
        log.warning("reaper: sent again %s (queued, but no message in the broker)", resent)
    return requeued, failed


def attach_missing_results(settings: Settings) -> None:
    """Results files of jobs that ended without one (cancelled or failed here, or a settle that could not
    write it); `results.attach` makes each once."""
    with get_db(settings).session() as s:
        for job_id in results.jobs_without_results(s):
            results.attach_committed(s, get_store(settings), job_id)


def resend_lost(settings: Settings) -> list[str]:
    """Send a token again for each queued job that may run and has none (its message was lost, or
    dropped while its tenant's budget was used). Only when the queue is empty, so a waiting queue is
    not flooded; a token too many finds nothing to run and leaves."""
    if queue_depth(settings) != 0:
        return []
    with get_db(settings).session() as s:
        lost = jobs_needing_tokens(s, QueuePolicy.of(settings), settings.resend_lost_after_seconds)
    now = time.monotonic()
    for job_id, at in list(_RESENT.items()):
        if now - at > settings.resend_lost_after_seconds:
            del _RESENT[job_id]
    # A token just sent leaves the queue before its worker claims the job: do not send another meanwhile.
    lost = [job_id for job_id in lost if job_id not in _RESENT]
    for job_id in lost:
        enqueue_run_job(settings, job_id)
        _RESENT[job_id] = now
    return lost


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


def start_beat_thread(settings: Settings, name: str) -> threading.Event:
    """This worker's beat (store.workers) every heartbeat interval, until the returned event is set."""
    from store import workers

    stop = threading.Event()

    def loop() -> None:
        while True:
            try:
                workers.beat(settings, name)
            except Exception as exc:  # Redis down: the beat resumes with it
                log.warning("worker beat: %s", exc)
            if stop.wait(settings.heartbeat_seconds):
                return

    threading.Thread(target=loop, name="gspo-worker-beat", daemon=True).start()
    return stop
