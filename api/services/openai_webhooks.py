"""OpenAI's webhook endpoint objects (``client.webhooks.create/list/retrieve/delete``) over api/services/webhooks.py."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.errors import ApiError
from api.openai_schemas import (
    DeletedWebhookEndpoint,
    ListOut,
    WebhookEndpoint,
    WebhookEndpointCreate,
    WebhookEndpointWithSecret,
)
from api.schemas import WebhookCreate, as_utc
from api.services import webhooks as native
from store import webhooks as store
from store.models import Tenant
from store.models import WebhookEndpoint as Row
from store.settings import Settings


def to_openai(ep: Row) -> WebhookEndpoint:
    created = int(as_utc(ep.created_at).timestamp())
    return WebhookEndpoint(
        id=ep.id,
        created_at=created,
        updated_at=created,
        event_types=ep.events,
        name=ep.name or "",
        url=ep.url,
        signing_secret_hint="whsec_..." + ep.secret[-4:],
    )


def create(s: Session, settings: Settings, tenant: Tenant, req: WebhookEndpointCreate) -> WebhookEndpointWithSecret:
    """A 400 naming ``event_types`` for an event this service does not send, ``url`` for a refused URL."""
    for event in req.event_types:
        if event not in store.EVENTS:
            raise ApiError(
                400,
                "unsupported_event_type",
                f"event_types: {event!r} is not sent by this service (it sends {', '.join(store.EVENTS)})",
                "event_types",
            )
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
