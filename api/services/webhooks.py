"""Webhook endpoints of a tenant (register, list, delete) and their deliveries; the sending is the worker's."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from api.errors import ApiError
from api.schemas import (
    WebhookCreate,
    WebhookCreated,
    WebhookDeliveryOut,
    WebhookDeliveryPage,
    WebhookList,
    WebhookOut,
    as_utc,
)
from gspo_core.egress import UserUrlError, check_user_url
from gspo_core.urls import redact_userinfo
from store import webhooks as store
from store.db import checkpoint_wal
from store.models import Tenant, WebhookDelivery, WebhookEndpoint
from store.settings import Settings


def _unix(at: datetime | None) -> int | None:
    return None if at is None else int(as_utc(at).timestamp())


def check_url(settings: Settings, url: str) -> str:
    """An http(s) URL whose host is no refused address literal or loopback name (a 422 naming ``url``).
    Other names are checked at each delivery, when resolved, and the connection pinned to the checked address."""
    try:
        return check_user_url(url, settings.grader_policy()["egress_allow"])
    except UserUrlError as exc:
        raise ApiError(422, "url_refused" if exc.refused else "invalid_url", f"url: {exc}", "url") from None


def to_out(ep: WebhookEndpoint) -> WebhookOut:
    return WebhookOut(
        id=ep.id, url=redact_userinfo(ep.url), name=ep.name, events=ep.events, created_at=_unix(ep.created_at) or 0
    )


def create(s: Session, settings: Settings, tenant: Tenant, req: WebhookCreate) -> WebhookCreated:
    """A new endpoint and its signing secret, shown this once; 409 past the tenant's cap."""
    url = check_url(settings, req.url)
    events = [e for e in store.EVENTS if req.events is None or e in req.events]
    try:
        ep = store.create_endpoint(s, tenant.id, url, events, settings.max_webhooks_per_tenant, req.name)
    except store.TooManyEndpoints as exc:
        s.rollback()
        raise ApiError(409, "too_many_webhooks", f"{exc}; delete one first", "url") from None
    s.commit()
    return WebhookCreated(**to_out(ep).model_dump(), secret=ep.secret)


def list_all(s: Session, tenant: Tenant) -> WebhookList:
    return WebhookList(data=[to_out(ep) for ep in store.list_endpoints(s, tenant.id)])


def delete(s: Session, ep: WebhookEndpoint) -> None:
    store.delete_endpoint(s, ep.id)
    s.commit()
    checkpoint_wal(s.get_bind().engine)  # the signing secret leaves SQLite's WAL file


def delivery_out(d: WebhookDelivery) -> WebhookDeliveryOut:
    return WebhookDeliveryOut.model_validate(
        {
            "id": d.id,
            "endpoint_id": d.endpoint_id,
            "event_id": d.event_id,
            "event_type": d.event_type,
            "job_id": d.job_id,
            "status": d.status,
            "attempts": d.attempts,
            "last_status_code": d.last_status_code,
            "last_error": d.last_error,
            "next_attempt_at": _unix(d.next_attempt_at) if d.status == "pending" else None,
            "created_at": _unix(d.created_at),
            "finished_at": _unix(d.finished_at),
            "history": d.history or [],
        }
    )


def deliveries(s: Session, ep: WebhookEndpoint, limit: int, after: str | None) -> WebhookDeliveryPage:
    rows = store.list_deliveries(s, ep.id, limit + 1, after)
    return WebhookDeliveryPage(data=[delivery_out(d) for d in rows[:limit]], has_more=len(rows) > limit)
