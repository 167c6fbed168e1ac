"""The FastAPI application factory: routers, error handlers, limits, Prometheus metrics."""

from __future__ import annotations


import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import func, select

from api import errors
from api.routers import checkpoints, files, health, jobs, metrics, rewards, ui
from api.schemas import ErrorBody
from store.db import Database
from store.models import Job
from store.objects import get_object_store
from store.settings import Settings, get_settings


def _instrument(app: FastAPI) -> None:
    reg = CollectorRegistry()
    requests = Counter("gspo_http_requests_total", "HTTP requests", ["method", "route", "status"], registry=reg)
    latency = Histogram("gspo_http_request_seconds", "HTTP latency", ["method", "route"], registry=reg)
    job_gauge = Gauge("gspo_jobs", "Jobs by status", ["status"], registry=reg)

    def observe_jobs() -> None:
        with app.state.db.session() as s:
            counts = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        for status in ("queued", "running", "cancelling", "succeeded", "failed", "cancelled"):
            job_gauge.labels(status).set(counts.get(status, 0))

    app.state.registry, app.state.observe_jobs = reg, observe_jobs
    gate = asyncio.Semaphore(32)

    @app.middleware("http")
    async def _metrics_and_limits(request: Request, call_next):
        length = request.headers.get("content-length")
        limit = app.state.settings.max_upload_bytes + 65536 if request.url.path == "/v1/files" \
            else app.state.settings.max_request_bytes
        if length and length.isdigit() and int(length) > limit:
            return JSONResponse(errors.body("request_too_large", f"request body exceeds {limit} bytes"), 413)
        t0 = time.perf_counter()
        if request.url.path.endswith("/events"):  # long-lived streams use their own short sessions
            response = await call_next(request)
        else:
            # Bound requests in flight below the DB pool: a request holds its connection while it
            # waits for a worker thread, so unbounded concurrency would exhaust the pool.
            async with gate:
                response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        requests.labels(request.method, route, str(response.status_code)).inc()
        latency.labels(request.method, route).observe(time.perf_counter() - t0)
        return response


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the database, object store and settings live on ``app.state``."""
    settings = settings or get_settings()
    common = {code: {"model": ErrorBody} for code in (400, 401, 404, 413, 422, 503)}
    app = FastAPI(title="GSPO training service", version="0.1.0", responses=common,
                  description="Reinforcement-learning fine-tuning (GSPO) of open-weight LMs as a service.")
    app.state.settings = settings
    app.state.db = Database(settings.resolved_database_url())
    app.state.objects = get_object_store(settings)
    errors.install(app)
    _instrument(app)
    for router in (files.router, jobs.router, metrics.router, checkpoints.router, rewards.router, health.router):
        app.include_router(router)
    app.include_router(ui.router)
    app.mount("/static", ui.static_app, name="static")
    return app
