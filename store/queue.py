"""Enqueue work for the worker by task name, so the API never imports the worker package."""

from __future__ import annotations

from functools import lru_cache

from store.private import private_dir
from store.settings import Settings

RUN_JOB_TASK = "worker.tasks.run_job"


def broker_url(settings: Settings) -> str:
    """Redis when configured; else a server-less filesystem broker under the data directory."""
    # The filesystem transport ignores the host; naming kombu's default spares a warning at every connection.
    return settings.redis_url or "filesystem://localhost//"


def broker_options(settings: Settings) -> dict:
    if settings.redis_url:
        # Longer than any sane job step gap; leases (not redelivery) handle crashed workers.
        return {"visibility_timeout": 12 * 3600}
    folder = (settings.data_dir / "broker").resolve()
    for sub in ("queue", "control", "processed"):
        private_dir(folder / sub)
    return {
        "data_folder_in": str(folder / "queue"),
        "data_folder_out": str(folder / "queue"),
        "control_folder": str(folder / "control"),
        "processed_folder": str(folder / "processed"),
        "store_processed": False,
        "polling_interval": 0.2,
    }


@lru_cache(maxsize=4)
def _producer(url: str, options_key: tuple):
    from celery import Celery

    app = Celery("gspo-producer", broker=url)
    app.conf.broker_transport_options = dict(options_key)
    app.conf.broker_connection_retry_on_startup = True
    return app


def reset_producers() -> None:
    """Drop producer connections inherited across a fork (each process opens its own)."""
    _producer.cache_clear()


def enqueue_run_job(settings: Settings, job_id: str) -> None:
    """Publish ``worker.tasks.run_job(job_id)`` on the worker queue."""
    app = _producer(broker_url(settings), tuple(sorted(broker_options(settings).items())))
    app.send_task(RUN_JOB_TASK, args=[job_id], queue=settings.worker_queue)


def broker_reachable(settings: Settings) -> bool:
    """Readiness: can we open a connection to the broker right now?"""
    app = _producer(broker_url(settings), tuple(sorted(broker_options(settings).items())))
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        return True
    except Exception:
        return False


def queue_depth(settings: Settings) -> int | None:
    """Messages waiting in the worker queue (not those a worker already holds); None when the
    broker cannot be asked right now."""
    from kombu.exceptions import ChannelError

    app = _producer(broker_url(settings), tuple(sorted(broker_options(settings).items())))
    try:
        with app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
            try:
                return int(conn.default_channel.queue_declare(queue=settings.worker_queue, passive=True).message_count)
            except ChannelError:  # never declared, or (Redis) an empty list: no message waits
                return 0
    except Exception:
        return None
