"""Annotated dependencies: settings, database session, object store, tenant, owned resources."""

from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Header, Path, Request
from sqlalchemy.orm import Session

from api.errors import ApiError, not_found
from store.models import Checkpoint, File, Job, Tenant
from store.settings import Settings
from store.tenants import authenticate


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.db.session() as s:
        yield s


def get_objects(request: Request):
    return request.app.state.objects


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
ObjectsDep = Annotated[object, Depends(get_objects)]


def current_tenant(s: SessionDep, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    """The tenant of the ``Authorization: Bearer <key>`` header; 401 otherwise."""
    scheme, _, key = (authorization or "").partition(" ")
    tenant = authenticate(s, key.strip()) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise ApiError(401, "unauthorized", "missing or invalid API key (Authorization: Bearer <key>)",
                       headers={"WWW-Authenticate": "Bearer"})
    return tenant


TenantDep = Annotated[Tenant, Depends(current_tenant)]


def owned_job(s: SessionDep, tenant: TenantDep, job_id: Annotated[str, Path(max_length=64)]) -> Job:
    job = s.get(Job, job_id)
    if job is None or job.tenant_id != tenant.id:  # another tenant's job is indistinguishable from none
        raise not_found("job", job_id)
    return job


def owned_file(s: SessionDep, tenant: TenantDep, file_id: Annotated[str, Path(max_length=64)]) -> File:
    f = s.get(File, file_id)
    if f is None or f.tenant_id != tenant.id:
        raise not_found("file", file_id)
    return f


def owned_checkpoint(s: SessionDep, tenant: TenantDep,
                     checkpoint_id: Annotated[str, Path(max_length=64)]) -> Checkpoint:
    c = s.get(Checkpoint, checkpoint_id)
    if c is None or c.tenant_id != tenant.id:
        raise not_found("checkpoint", checkpoint_id)
    return c


JobDep = Annotated[Job, Depends(owned_job)]
FileDep = Annotated[File, Depends(owned_file)]
CheckpointDep = Annotated[Checkpoint, Depends(owned_checkpoint)]
