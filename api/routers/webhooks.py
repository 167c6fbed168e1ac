"""/v1/webhooks: register an endpoint for job events, list, delete, and its deliveries."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.bodies import StrictJsonRoute
from api.deps import SessionDep, SettingsDep, TenantDep, WebhookDep
from api.schemas import WebhookCreate, WebhookCreated, WebhookDeliveryPage, WebhookList, error_responses
from api.services import webhooks as svc

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], route_class=StrictJsonRoute)
ERRORS = error_responses(401, 404, 422)


@router.post("", response_model=WebhookCreated, status_code=201, responses={**error_responses(409), **ERRORS})
def create_webhook(req: WebhookCreate, s: SessionDep, settings: SettingsDep, tenant: TenantDep) -> WebhookCreated:
    """The endpoint with its signing secret (``whsec_...``), which is never shown again. A URL this service
    may not reach is a 422 naming ``url``; past GSPO_MAX_WEBHOOKS_PER_TENANT endpoints a 409."""
    return svc.create(s, settings, tenant, req)


@router.get("", response_model=WebhookList, responses=ERRORS)
def list_webhooks(s: SessionDep, tenant: TenantDep) -> WebhookList:
    return svc.list_all(s, tenant)


@router.delete("/{webhook_id}", status_code=204, responses=ERRORS)
def delete_webhook(ep: WebhookDep, s: SessionDep) -> None:
    """The endpoint and its deliveries (pending ones are not sent)."""
    svc.delete(s, ep)


@router.get("/{webhook_id}/deliveries", response_model=WebhookDeliveryPage, responses=ERRORS)
def list_deliveries(
    ep: WebhookDep,
    s: SessionDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> WebhookDeliveryPage:
    """Each event sent to this endpoint: attempts, the last status code and error (never the receiver's
    body), the next attempt's time."""
    return svc.deliveries(s, ep, limit, after)
