"""The Celery application: Redis in production, a filesystem broker in the embedded default."""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from celery import Celery, signals

from store.queue import broker_options, broker_url
from store.settings import Settings, get_settings

log = logging.getLogger(__name__)
# Sent by the main process to its pool child on warm shutdown: the job checkpoints and is requeued.
# SIGURG, not SIGUSR2: in the pool the embedded (filesystem) broker runs, billiard puts its exit handler on
# SIGUSR2 and other signals after the child's init hook, so SIGUSR2 ended a running job without its
# checkpoint and an idle child with "exited with 'exitcode 70'". SIGURG is none of billiard's, and its
# default is to be ignored: a child that has no handler yet is not harmed.
GRACEFUL_SIGNAL = signal.SIGURG


def make_celery(settings: Settings) -> Celery:
    """One job per process at a time (prefork, concurrency 1, a fresh child per job so that its exit
    frees GPU memory); acks_late + prefetch 1 on the `gpu` queue; job leases make duplicates harmless."""
    app = Celery("gspo", broker=broker_url(settings), include=["worker.tasks"])
    app.conf.update(
        broker_transport_options=broker_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # ride out a Redis restart
        task_acks_late=True,
        task_reject_on_worker_lost=True,  # a crashed child's job message goes back to the queue
        worker_prefetch_multiplier=1,
        worker_pool="prefork",
        worker_concurrency=1,
        worker_max_tasks_per_child=1,
        worker_proc_alive_timeout=60,  # a new job process may start slowly on a loaded machine
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


@signals.after_setup_logger.connect
def _setup_logging(loglevel=None, **_):
    from worker.logs import configure_process

    configure_process(loglevel or logging.WARNING)


@signals.worker_ready.connect
def _start_reaper(sender=None, **_):
    # The main process of every worker reaps: a busy worker's queue cannot carry the reap task
    # (concurrency 1), and the row locks in store.jobs.reap make concurrent reapers safe.
    # Webhook deliveries are sent from here too, for the same reason (worker/webhooks.py).
    from worker.reaper import start_beat_thread, start_reaper_thread
    from worker.webhooks import start_sender_thread

    start_reaper_thread(get_settings())
    start_sender_thread(get_settings())
    global _BEAT
    _BEAT = (start_beat_thread(get_settings(), sender.hostname), sender.hostname)


_BEAT: tuple | None = None  # the beat thread's stop event and this worker's name, once ready


@signals.worker_shutdown.connect
def _stop_beat(**_):
    """A clean stop says so at once (a killed worker's beat runs out instead)."""
    from store import workers

    if _BEAT is not None:
        _BEAT[0].set()
        with contextlib.suppress(Exception):
            workers.forget(get_settings(), _BEAT[1])


@signals.worker_process_init.connect
def _child_init(**_):
    from store import queue
    from worker import context

    context.reset_after_fork()
    queue.reset_producers()
    signal.signal(GRACEFUL_SIGNAL, lambda *_: context.SHUTDOWN.set())


@signals.worker_shutting_down.connect
def _graceful(sig=None, how=None, **_):
    """Warm shutdown (SIGTERM/SIGINT) of the main process: ask the running job to checkpoint and
    requeue itself; the main process then waits for the task to return, acks it and exits."""
    import psutil
    from celery.worker import state

    from worker import context

    # Inherited by a job process forked from now on: the consumer of the embedded broker can still take a
    # message (the requeued job's own) until it stops, and that process must leave the job alone.
    context.SHUTDOWN.set()
    for child in psutil.Process().children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, GRACEFUL_SIGNAL)
    if state.active_requests:  # an idle worker's stop is no news
        log.warning("%s shutdown: asked the running job to checkpoint and requeue", how)
