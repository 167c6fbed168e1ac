"""OpenAI's webhook endpoint objects (``client.webhooks.create/list/retrieve/update/delete/rotate_secret/test``)
over api/services/webhooks.py."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from api.errors import ApiError
from api.openai_schemas import (
    DeletedWebhookEndpoint,
    ListOut,
    WebhookEndpoint,
    WebhookEndpointCreate,
    WebhookEndpointTestResult,
    WebhookEndpointUpdate,
    WebhookEndpointWithSecret,
    WebhookRotateSecret,
    WebhookTest,
)
from api.schemas import WebhookCreate, as_utc
from api.services import webhooks as native
from gspo_core.delivery import make_client, post
from gspo_core.egress import EgressPolicy
from gspo_core.urls import redact_userinfo
from store import webhooks as store
from store.models import Tenant, new_id
from store.models import WebhookEndpoint as Row
from store.settings import Settings

#: Tenants with a test delivery in flight in this API process: one at a time each (it holds a thread).
_testing: set[str] = set()
_testing_lock = threading.Lock()


def to_openai(ep: Row) -> WebhookEndpoint:
    created = int(as_utc(ep.created_at).timestamp())
    return WebhookEndpoint(
        id=ep.id,
        created_at=created,
        updated_at=int(as_utc(ep.updated_at).timestamp()) if ep.updated_at else created,
        event_types=ep.events,
        name=ep.name or "",
        url=redact_userinfo(ep.url),
        signing_secret_hint="whsec_..." + ep.secret[-4:],
    )


def create(s: Session, settings: Settings, tenant: Tenant, req: WebhookEndpointCreate) -> WebhookEndpointWithSecret:
    """A 400 naming ``event_types`` for an event this service does not send, ``url`` for a refused URL."""
    _check_events(req.event_types, "event_types")
    made = native.create(
        s, settings, tenant, WebhookCreate.model_validate({"url": req.url, "events": req.event_types, "name": req.name})
    )
    ep = s.get_one(Row, made.id)
    return WebhookEndpointWithSecret(**to_openai(ep).model_dump(), signing_secret=made.secret)


def list_page(s: Session, tenant: Tenant, limit: int, after: str | None) -> ListOut[WebhookEndpoint]:
    """Newest first (at most GSPO_MAX_WEBHOOKS_PER_TENANT of them); ``after`` an id of the previous page."""
    rows = store.list_endpoints(s, tenant.id)
    ids = [r.id for r in rows]
    if after in ids:
        rows = rows[ids.index(after) + 1 :]
    page = [to_openai(r) for r in rows[:limit]]
    return ListOut[WebhookEndpoint](
        data=page,
        has_more=len(rows) > limit,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
    )


def delete(s: Session, ep: Row) -> DeletedWebhookEndpoint:
    native.delete(s, ep)
    return DeletedWebhookEndpoint(id=ep.id)


def _check_events(events: list[str], param: str) -> None:
    for event in events:
        if event not in store.EVENTS:
            raise ApiError(
                400,
                "unsupported_event_type",
                f"{param}: {event!r} is not sent by this service (it sends {', '.join(store.EVENTS)})",
                param,
            )


def update(s: Session, settings: Settings, ep: Row, req: WebhookEndpointUpdate) -> WebhookEndpoint:
    """Sets what is given (the URL checked as at creation); ``updated_at`` moves only on a change."""
    if req.event_types is not None:
        _check_events(req.event_types, "event_types")
    url = native.check_url(settings, req.url) if req.url is not None else None
    events = None if req.event_types is None else [e for e in store.EVENTS if e in req.event_types]
    store.update_endpoint(s, ep, url, req.name, events)
    s.commit()
    return to_openai(ep)


def rotate_secret(s: Session, ep: Row, req: WebhookRotateSecret) -> WebhookEndpointWithSecret:
    """A new secret, shown this once; with ``keep_old_secret_active_for_24_hours`` deliveries carry a
    signature by each secret for 24 hours, so receivers can switch without missing one."""
    keep = timedelta(hours=24) if req.keep_old_secret_active_for_24_hours else None
    store.rotate_secret(s, ep, keep)
    s.commit()
    return WebhookEndpointWithSecret(**to_openai(ep).model_dump(), signing_secret=ep.secret)


def test(settings: Settings, ep: Row, req: WebhookTest) -> WebhookEndpointTestResult:
    """Sends a sample event (``data.id`` ``ftjob_test``) signed like a real delivery, once, now, through the
    egress policy; the receiver's status code comes back (0 and ``error`` when it gave none), ``success`` only for
    a 2xx. Not stored."""
    _check_events([req.event_type], "event_type")
    with _testing_lock:
        if ep.tenant_id in _testing:
            raise ApiError(429, "rate_limit_exceeded", "a test delivery of this tenant is being sent; retry", None)
        _testing.add(ep.tenant_id)
    try:
        now = datetime.now(UTC)
        _, payload = store.event_payload(req.event_type, "ftjob_test")
        msg_id = new_id("msg")
        headers = store.signed_headers(msg_id, store.signing_secrets(ep, now), payload, now)
        policy = EgressPolicy(settings.grader_policy()["egress_allow"])
        with make_client(policy, settings.webhook_timeout_seconds, 1) as client:
            code, error, _ = post(client, ep.url, payload.encode(), headers)
    finally:
        with _testing_lock:
            _testing.discard(ep.tenant_id)
    return WebhookEndpointTestResult(
        webhook_endpoint_id=ep.id, event_type=req.event_type, status_code=code or 0, success=error is None, error=error
    )
