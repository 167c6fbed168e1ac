"""The Celery application: Redis in production, a filesystem broker in the embedded default."""

from __future__ import annotations

from celery import Celery, signals

from store.queue import broker_options, broker_url
from store.settings import Settings, get_settings


def make_celery(settings: Settings) -> Celery:
    """One job at a time per process: acks_late + prefetch 1; a `gpu` queue; leases guard duplicates."""
    app = Celery("gspo", broker=broker_url(settings), include=["worker.tasks"])
    app.conf.update(
        broker_transport_options=broker_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # ride out a Redis restart
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_default_queue=settings.worker_queue,
        task_ignore_result=True,
        worker_redirect_stdouts=False,
        worker_hijack_root_logger=False,
        task_routes={"worker.tasks.run_job": {"queue": settings.worker_queue}},
    )
    return app


class _LazyApp:
    """`celery -A worker.celery_app` needs a module-level app; settings are read on first use."""

    _app: Celery | None = None

    def get(self) -> Celery:
        if self._app is None:
            self._app = make_celery(get_settings())
        return self._app


_lazy = _LazyApp()


def __getattr__(name: str):
    if name in ("app", "celery"):
        return _lazy.get()
    raise AttributeError(name)


@signals.worker_ready.connect
def _start_reaper(sender=None, **_):
    from worker.reaper import start_reaper_thread

    start_reaper_thread(get_settings())


@signals.worker_shutting_down.connect
def _graceful(sig=None, how=None, **_):
    from worker.runner import SHUTDOWN

    SHUTDOWN.set()
