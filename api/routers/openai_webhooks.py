"""/v1/webhook_endpoints: OpenAI's webhook endpoint API (create, list, retrieve, update, delete, rotate_secret,
test) for the `openai` SDK."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.bodies import StrictJsonRoute
from api.deps import SessionDep, SettingsDep, TenantDep, WebhookDep
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
    openai_errors,
)
from api.services import openai_webhooks as svc

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["openai webhooks"], route_class=StrictJsonRoute)
ERRORS = openai_errors(400, 401, 404, 409, 429)


@router.post("", response_model=WebhookEndpointWithSecret, responses=ERRORS)
def create_endpoint(
    req: WebhookEndpointCreate, s: SessionDep, settings: SettingsDep, tenant: TenantDep
) -> WebhookEndpointWithSecret:
    """The endpoint with its ``signing_secret``, shown only here (as ``POST /v1/webhooks``)."""
    return svc.create(s, settings, tenant, req)


@router.get("", response_model=ListOut[WebhookEndpoint], responses=ERRORS)
def list_endpoints(
    s: SessionDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> ListOut[WebhookEndpoint]:
    return svc.list_page(s, tenant, limit, after)


@router.get("/{webhook_id}", response_model=WebhookEndpoint, responses=ERRORS)
def get_endpoint(ep: WebhookDep) -> WebhookEndpoint:
    return svc.to_openai(ep)


@router.delete("/{webhook_id}", response_model=DeletedWebhookEndpoint, responses=ERRORS)
def delete_endpoint(ep: WebhookDep, s: SessionDep) -> DeletedWebhookEndpoint:
    return svc.delete(s, ep)


@router.post("/{webhook_id}", response_model=WebhookEndpoint, responses=ERRORS)
def update_endpoint(
    req: WebhookEndpointUpdate, ep: WebhookDep, s: SessionDep, settings: SettingsDep
) -> WebhookEndpoint:
    return svc.update(s, settings, ep, req)


@router.post("/{webhook_id}/rotate_secret", response_model=WebhookEndpointWithSecret, responses=ERRORS)
def rotate_secret(req: WebhookRotateSecret, ep: WebhookDep, s: SessionDep) -> WebhookEndpointWithSecret:
    """The new ``signing_secret``, shown only here."""
    return svc.rotate_secret(s, ep, req)


@router.post("/{webhook_id}/test", response_model=WebhookEndpointTestResult, responses=ERRORS)
def test_endpoint(req: WebhookTest, ep: WebhookDep, settings: SettingsDep) -> WebhookEndpointTestResult:
    """Sends a sample event now and returns the endpoint's status code."""
    return svc.test(settings, ep, req)
