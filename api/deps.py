"""Annotated dependencies: settings, database session, object store, tenant, owned resources."""

from __future__ import annotations

from typing import Annotated, AsyncIterator

from fastapi import Depends, Header, Path, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError, not_found
from store.models import Checkpoint, File, Job, Tenant
from store.settings import Settings
from store.tenants import authenticate, owned_by_key


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


# The async dependencies below do no I/O on the event loop; being async saves each request a hop to
# the thread pool (~0.15 ms each, more under load), which the 200-client polling load test showed.
async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session. GET/HEAD read through an autocommit session (no BEGIN/COMMIT, and
    closing it sends nothing); other methods get one transaction, committed after the handler."""
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
        await run_in_threadpool(s.commit)
    except BaseException:
        await run_in_threadpool(s.rollback)
        raise
    finally:
        await run_in_threadpool(s.close)


async def get_objects(request: Request):
    return request.app.state.objects


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
ObjectsDep = Annotated[object, Depends(get_objects)]


def _bearer(authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def _unauthorized() -> ApiError:
    return ApiError(401, "unauthorized", "missing or invalid API key (Authorization: Bearer <key>)",
                    headers={"WWW-Authenticate": "Bearer"})


def current_tenant(s: SessionDep, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    """The tenant of the ``Authorization: Bearer <key>`` header; 401 otherwise."""
    tenant = authenticate(s, _bearer(authorization))
    if tenant is None:
        raise _unauthorized()
    return tenant


TenantDep = Annotated[Tenant, Depends(current_tenant)]


def _owned(s: Session, model, kind: str, row_id: str, authorization: str | None):
    """The caller's row, found with its key in one query (status polling calls this hundreds of times
    a second); 401 for a bad key, 404 for a row that is missing or another tenant's (indistinguishable)."""
    key = _bearer(authorization)
    row = owned_by_key(s, model, row_id, key)
    if row is not None:
        return row
    if authenticate(s, key) is None:
        raise _unauthorized()
    raise not_found(kind, row_id)


def owned_job(s: SessionDep, job_id: Annotated[str, Path(max_length=64)],
              authorization: Annotated[str | None, Header()] = None) -> Job:
    return _owned(s, Job, "job", job_id, authorization)


def owned_file(s: SessionDep, file_id: Annotated[str, Path(max_length=64)],
               authorization: Annotated[str | None, Header()] = None) -> File:
    return _owned(s, File, "file", file_id, authorization)


def owned_checkpoint(s: SessionDep, checkpoint_id: Annotated[str, Path(max_length=64)],
                     authorization: Annotated[str | None, Header()] = None) -> Checkpoint:
    return _owned(s, Checkpoint, "checkpoint", checkpoint_id, authorization)


JobDep = Annotated[Job, Depends(owned_job)]
FileDep = Annotated[File, Depends(owned_file)]
CheckpointDep = Annotated[Checkpoint, Depends(owned_checkpoint)]
