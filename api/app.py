"""The FastAPI application factory: routers, error handlers, limits, Prometheus metrics."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import cache

from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import BaseRoute

from api import errors
from api.limits import Limits
from api.middleware import BodyLimitMiddleware, MetricsMiddleware
from api.routers import (
    checkpoints,
    files,
    fine_tuning,
    health,
    jobs,
    metrics,
    openai_webhooks,
    rewards,
    tinker,
    tinker_runs,
    tinker_sessions,
    ui,
    usage,
    webhooks,
)
from api.schemas import error_responses
from api.services.deletion import purge
from api.services.health import Monitoring
from gspo_core.urls import redact_logged_userinfo
from store.db import Database
from store.objects import get_object_store
from store.settings import Settings, get_settings

log = logging.getLogger(__name__)
#: Threads that run event streams' polls (each a short query): streams never take the shared pool's.
STREAM_POLL_THREADS = 4


def _instrument(app: FastAPI) -> None:
    # Under `gspo api --workers N` each process counts into PROMETHEUS_MULTIPROC_DIR and a scrape of
    # any of them aggregates all (run_api sets it up before uvicorn forks).
    multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    reg = CollectorRegistry()
    requests = Counter("gspo_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=reg)
    latency = Histogram("gspo_http_request_seconds", "HTTP latency", ["method", "route"], registry=reg)
    job_gauge = Gauge("gspo_jobs", "Jobs by status", ["status"], registry=reg, multiprocess_mode="mostrecent")
    if multiprocess:
        from prometheus_client import multiprocess as mp

        reg = CollectorRegistry()
        mp.MultiProcessCollector(reg)

    app.state.monitoring = Monitoring(reg, job_gauge, app.state.db)
    settings = app.state.settings
    # Starlette wraps the last added outermost: metrics see the body limit's 413s.
    app.add_middleware(
        BodyLimitMiddleware,
        limit_for=lambda path: settings.max_upload_bytes + 65536 if path == "/v1/files" else settings.max_request_bytes,
        rate_for=lambda path: settings.upload_bytes_per_second if path == "/v1/files" else 0.0,
    )
    app.add_middleware(MetricsMiddleware, requests=requests, latency=latency)


def _per_lifespan(app: FastAPI) -> None:
    """What belongs to one run of the event loop: the limiter's Redis client, the threads of event
    streams' polls and of dry runs (their own, so neither can take the threads other requests need)."""
    app.state.limits = Limits(app.state.settings.redis_url)
    app.state.stream_pool = ThreadPoolExecutor(max_workers=STREAM_POLL_THREADS, thread_name_prefix="sse-poll")
    app.state.grading_pool = ThreadPoolExecutor(
        max_workers=app.state.settings.max_reward_runs_per_process, thread_name_prefix="dry-run"
    )


def _purge_leftovers(app: FastAPI) -> None:
    try:
        purge(app.state.db, app.state.objects, limit=10_000)
    except Exception as exc:  # the next deletion or start tries again
        log.warning("could not purge pending deletions: %s", exc)
    try:  # what a crashed API or worker was writing (an upload, a checkpoint)
        if removed := app.state.objects.remove_stale_parts():
            log.info("removed %d partial object(s) left by interrupted writes", removed)
    except Exception as exc:
        log.warning("could not remove partial objects: %s", exc)


_freezing = threading.Lock()


def _freeze_loaded_objects() -> None:
    """Everything loaded so far lives as long as the process: keep it out of the cyclic GC, whose full passes
    over it stalled every request (the load test's p99 spikes; docs/bench.md). Done where nothing is frozen: a
    later app in the same process (tests, `gspo up` restarting its API) finds it done, unless other code
    unfroze the heap meanwhile (an in-process vLLM engine does at its shutdown). Frozen objects are never
    collected, not even at exit, where an extension loaded in the process then reports them as leaks
    (triton's, which transformers loads in `gspo demo`'s process: "nanobind: leaked ..."): they are
    unfrozen at the process's exit."""
    with _freezing:
        if gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
            atexit.unregister(gc.unfreeze)  # registered once, however often the heap is frozen
            atexit.register(gc.unfreeze)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    _freeze_loaded_objects()
    # Under a tenant's load (uploads' copy threads, dry runs' pipe readers, stream polls) the event loop
    # queues behind those threads for the GIL, one switch interval each time: a shorter one bounds that
    # wait for every other request (docs/bench.md, "Fairness").
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(app.state.settings.api_switch_interval_ms / 1000)
    _per_lifespan(app)
    # Objects of rows deleted just before a crash or during an object-store outage.
    threading.Thread(target=_purge_leftovers, args=(app,), name="purge", daemon=True).start()
    yield
    sys.setswitchinterval(switch_interval)
    await app.state.limits.close()
    app.state.stream_pool.shutdown(wait=False, cancel_futures=True)
    app.state.grading_pool.shutdown(wait=False, cancel_futures=True)


#: The routers of the API, in the order their routes are matched.
ROUTERS = (
    files.router,
    jobs.router,
    metrics.router,
    checkpoints.router,
    rewards.router,
    fine_tuning.router,
    usage.router,
    webhooks.router,
    openai_webhooks.router,
    health.router,
    tinker.router,
    tinker_sessions.router,  # before tinker_runs: its checkpoint routes end in /publish, /ttl
    tinker_sessions.dashboard,
    tinker_runs.router,
    ui.router,
)
#: The error responses every route documents.
ERROR_RESPONSES = error_responses(400, 401, 404, 413, 422, 429, 503)


@cache
def _routes() -> tuple[BaseRoute, ...]:
    """The API's routes, built once per process. `include_router` builds every route of a router anew (its
    signature analysed, a pydantic adapter made per field: 0.2 CPU s for ours) in each app it is called on,
    and a process may build many apps (the suite builds ~700). Built here as the app's own router would build
    them (its error responses merged into each), for `FastAPI(routes=...)`; they keep no app state (handlers
    read ``request.app.state``). What they do not see is an app's ``dependency_overrides``: nothing sets any."""
    router = APIRouter(responses=ERROR_RESPONSES)
    for each in ROUTERS:
        router.include_router(each)
    return tuple(router.routes)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the database, object store and settings live on ``app.state``."""
    settings = settings or get_settings()
    redact_logged_userinfo()  # the webhook test's HTTP client logs the URLs it calls
    app = FastAPI(
        title="GSPO training service",
        version="0.1.0",
        routes=list(_routes()),
        responses=ERROR_RESPONSES,
        lifespan=_lifespan,
        description="Reinforcement-learning fine-tuning (GSPO) of open-weight LMs as a service.",
    )
    app.state.settings = settings
    app.state.db = Database(settings.resolved_database_url())
    app.state.objects = get_object_store(settings)
    _per_lifespan(app)  # again at each start of the lifespan
    errors.install(app)
    _instrument(app)
    app.mount("/static", ui.static_app, name="static")
    return app
