"""Annotated dependencies: settings, database, session, object store, limits, thread pools, tenant, owned rows."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Annotated, TypeVar

from fastapi import Depends, Header, Path, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError, not_found
from api.limits import Limits
from api.services.events import parse_last_event_id
from api.services.health import Monitoring
from store.db import Database
from store.models import Checkpoint, File, Job, Tenant, WebhookEndpoint
from store.objects import ObjectStore
from store.settings import Settings
from store.tenants import authenticate, owned_by_key

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OwnedRow = TypeVar("OwnedRow", Job, File, Checkpoint, WebhookEndpoint)


# The async dependencies below do no I/O on the event loop; being async saves each request a hop to
# the thread pool, which shows in the polling load test (bench.load_api; docs/bench.md).
async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


async def get_database(request: Request) -> Database:
    return request.app.state.db


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session. GET/HEAD read through an autocommit session (no BEGIN/COMMIT, and
    closing it sends nothing); other methods get one transaction, which the service that writes
    commits (one owner per transaction): closing it rolls back whatever was left uncommitted."""
    db = request.app.state.db
    if request.method in SAFE_METHODS:
        s = db.read_session()
        try:
            yield s
        finally:
            s.close()
        return
    s = db.new_session()
    try:
        yield s
    finally:
        await run_in_threadpool(s.close)


async def get_objects(request: Request) -> ObjectStore:
    return request.app.state.objects


async def get_limits(request: Request) -> Limits:
    return request.app.state.limits


async def get_stream_pool(request: Request) -> Executor:
    """The threads that run event streams' polls (never the shared pool's)."""
    return request.app.state.stream_pool


async def get_grading_pool(request: Request) -> Executor:
    """The threads that run dry runs' graders (as many as this process's dry-run slots)."""
    return request.app.state.grading_pool


async def get_monitoring(request: Request) -> Monitoring:
    return request.app.state.monitoring


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
DatabaseDep = Annotated[Database, Depends(get_database)]
# Closed when the handler returns, before the response is sent: a streamed response
# (events, downloads) holds no pooled connection while it streams.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ObjectsDep = Annotated[ObjectStore, Depends(get_objects)]
LimitsDep = Annotated[Limits, Depends(get_limits)]
StreamPoolDep = Annotated[Executor, Depends(get_stream_pool)]
GradingPoolDep = Annotated[Executor, Depends(get_grading_pool)]
MonitoringDep = Annotated[Monitoring, Depends(get_monitoring)]


def _bearer(authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def _unauthorized() -> ApiError:
    return ApiError(
        401,
        "unauthorized",
        "missing or invalid API key (Authorization: Bearer <key>)",
        headers={"WWW-Authenticate": "Bearer"},
    )


def current_tenant(request: Request, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    """The tenant of the ``Authorization: Bearer <key>`` header; 401 otherwise. Looked up in a session
    of its own, closed before the handler runs: grading, streaming or uploading holds no connection."""
    s = request.app.state.db.read_session()
    try:
        tenant = authenticate(s, _bearer(authorization))
    finally:
        s.close()
    if tenant is None:
        raise _unauthorized()
    return tenant


TenantDep = Annotated[Tenant, Depends(current_tenant)]


def tinker_tenant(
    request: Request,
    x_api_key: Annotated[str | None, Header(alias="X-API-Key")] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> Tenant:
    """The tenant of the Tinker SDK's ``X-API-Key: tml-<key>`` (the SDK demands the ``tml-`` prefix, so
    ``tml-<our key>`` is our key), or of a bearer key; 401 otherwise."""
    key = (x_api_key or "").removeprefix("tml-") or _bearer(authorization)
    s = request.app.state.db.read_session()
    try:
        tenant = authenticate(s, key)
    finally:
        s.close()
    if tenant is None:
        raise ApiError(401, "unauthorized", "missing or invalid API key (X-API-Key: tml-<key>)")
    return tenant


TinkerTenantDep = Annotated[Tenant, Depends(tinker_tenant)]


async def metrics_auth(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """The operator's ``GSPO_METRICS_TOKEN`` as a bearer token; /metrics is off (404) while it is unset."""
    if not settings.metrics_token:
        raise ApiError(404, "not_found", "/metrics is off; the operator turns it on with GSPO_METRICS_TOKEN")
    if not hmac.compare_digest(_bearer(authorization).encode(), settings.metrics_token.encode()):
        raise ApiError(
            401,
            "unauthorized",
            "GET /metrics needs Authorization: Bearer <GSPO_METRICS_TOKEN>",
            headers={"WWW-Authenticate": "Bearer"},
        )


MetricsAuthDep = Annotated[None, Depends(metrics_auth)]


def _owned(s: Session, model: type[OwnedRow], kind: str, row_id: str, authorization: str | None) -> OwnedRow:
    """The caller's row, found with its key in one query (status polling calls this hundreds of times
    a second); 401 for a bad key, 404 for a row that is missing or another tenant's (indistinguishable)."""
    key = _bearer(authorization)
    row = owned_by_key(s, model, row_id, key)
    if row is not None:
        return row
    if authenticate(s, key) is None:
        raise _unauthorized()
    raise not_found(kind, row_id)


def owned_job(
    s: SessionDep, job_id: Annotated[str, Path(max_length=64)], authorization: Annotated[str | None, Header()] = None
) -> Job:
    return _owned(s, Job, "job", job_id, authorization)


def owned_file(
    s: SessionDep, file_id: Annotated[str, Path(max_length=64)], authorization: Annotated[str | None, Header()] = None
) -> File:
    return _owned(s, File, "file", file_id, authorization)


def owned_checkpoint(
    s: SessionDep,
    checkpoint_id: Annotated[str, Path(max_length=64)],
    authorization: Annotated[str | None, Header()] = None,
) -> Checkpoint:
    return _owned(s, Checkpoint, "checkpoint", checkpoint_id, authorization)


def owned_webhook(
    s: SessionDep,
    webhook_id: Annotated[str, Path(max_length=64)],
    authorization: Annotated[str | None, Header()] = None,
) -> WebhookEndpoint:
    return _owned(s, WebhookEndpoint, "webhook", webhook_id, authorization)


JobDep = Annotated[Job, Depends(owned_job)]
FileDep = Annotated[File, Depends(owned_file)]
CheckpointDep = Annotated[Checkpoint, Depends(owned_checkpoint)]
WebhookDep = Annotated[WebhookEndpoint, Depends(owned_webhook)]


async def stream_slot(request: Request, job: JobDep, settings: SettingsDep, limits: LimitsDep) -> AsyncIterator[None]:
    """One of the tenant's event-stream slots, held until the response has been sent (or the client
    left): a request-scoped dependency's exit runs after the stream, whichever way it ends."""
    async with limits.slot(
        "event streams", job.tenant_id, settings.max_streams_per_tenant, settings.max_streams_per_process
    ):
        yield


StreamSlotDep = Annotated[None, Depends(stream_slot)]


async def last_event_position(last_event_id: Annotated[str | None, Header(max_length=64)] = None) -> tuple[int, int]:
    """``(event id, step)`` an event stream resumes after (``Last-Event-ID``); 400 naming the header."""
    return parse_last_event_id(last_event_id)


LastEventDep = Annotated[tuple[int, int], Depends(last_event_position)]
