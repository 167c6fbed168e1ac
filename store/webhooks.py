"""Webhooks: tenants' endpoints and the outbox of deliveries (written with a job's terminal status)."""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session
from standardwebhooks import Webhook

from store.models import Job, WebhookDelivery, WebhookEndpoint, new_id
from store.usage import as_utc

#: The events an endpoint may subscribe to (OpenAI's names); all of them when a tenant names none.
EVENTS = ("fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled")


class TooManyEndpoints(RuntimeError):
    """The tenant already has its maximum of webhook endpoints."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"at most {limit} webhook endpoints per tenant")


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per delivery and the exponential backoff between them (from Settings)."""

    max_attempts: int
    base_s: float
    cap_s: float

    def delay(self, attempts: int) -> float:
        """Seconds before the attempt after ``attempts`` failed ones: base, 2 x base, 4 x base, ... up to cap."""
        return min(self.cap_s, self.base_s * 2 ** max(0, attempts - 1))


@dataclass(frozen=True)
class Due:
    """A delivery the sender has claimed: what it needs to sign and send it."""

    id: str
    url: str
    secrets: tuple[str, ...]  # each signs: the current one, and a rotated-out one while it is kept
    payload: str
    attempts: int
    tenant_id: str


def _now() -> datetime:
    return datetime.now(UTC)


def new_secret() -> str:
    """A Standard Webhooks signing secret: ``whsec_`` and 24 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def create_endpoint(
    s: Session, tenant_id: str, url: str, events: list[str], max_endpoints: int, name: str | None = None
) -> WebhookEndpoint:
    """A new endpoint with a new secret; `TooManyEndpoints` past the cap, counted under the tenant's lock."""
    from store.jobs import lock_tenant  # store.jobs imports this module

    lock_tenant(s, tenant_id)
    count = s.scalar(select(func.count()).select_from(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id))
    if (count or 0) >= max_endpoints:
        raise TooManyEndpoints(max_endpoints)
    ep = WebhookEndpoint(tenant_id=tenant_id, url=url, name=name, events=list(events), secret=new_secret())
    s.add(ep)
    s.flush()
    return ep


def signing_secrets(ep: WebhookEndpoint, now: datetime) -> tuple[str, ...]:
    """The secrets a delivery is signed with: the endpoint's, and the previous one until it expires."""
    until = ep.previous_secret_until
    if ep.previous_secret and until is not None and as_utc(until) > now:
        return (ep.secret, ep.previous_secret)
    return (ep.secret,)


def signed_headers(msg_id: str, secrets_: tuple[str, ...], payload: str, at: datetime) -> dict[str, str]:
    """Standard Webhooks' headers: the message id, the time, and one ``v1,`` signature per secret
    (space-separated, as the spec allows during a rotation; receivers accept any that verifies)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": " ".join(Webhook(secret).sign(msg_id, at, payload) for secret in secrets_),
        "content-type": "application/json",
        "user-agent": "gspo-webhooks/1",
    }


def update_endpoint(
    s: Session, ep: WebhookEndpoint, url: str | None, name: str | None, events: list[str] | None
) -> WebhookEndpoint:
    """Set what is given; ``updated_at`` moves only when something changed."""
    changes = {k: v for k, v in (("url", url), ("name", name), ("events", events)) if v is not None}
    if any(getattr(ep, k) != v for k, v in changes.items()):
        for k, v in changes.items():
            setattr(ep, k, v)
        ep.updated_at = _now()
    return ep


def rotate_secret(s: Session, ep: WebhookEndpoint, keep_old_for: timedelta | None) -> WebhookEndpoint:
    """A new signing secret; the old one also signs for ``keep_old_for`` (None: it stops at once)."""
    now = _now()
    ep.previous_secret = ep.secret if keep_old_for else None
    ep.previous_secret_until = now + keep_old_for if keep_old_for else None
    ep.secret, ep.updated_at = new_secret(), now
    return ep


def event_payload(event_type: str, job_id: str) -> tuple[str, str]:
    """A new event's id and its exact body (OpenAI's event object)."""
    event_id = new_id("evt")
    event = {"id": event_id, "object": "event", "type": event_type, "created_at": int(time.time())}
    event["data"] = {"id": job_id}
    return event_id, json.dumps(event, separators=(",", ":"))


def list_endpoints(s: Session, tenant_id: str) -> list[WebhookEndpoint]:
    q = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
    return list(s.scalars(q.order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc())))


def delete_endpoint(s: Session, endpoint_id: str) -> None:
    """The endpoint and its deliveries (pending ones are not sent)."""
    s.execute(delete(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id))
    s.execute(delete(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id))


def list_deliveries(s: Session, endpoint_id: str, limit: int, after: str | None = None) -> list[WebhookDelivery]:
    """Newest first; ``after`` a delivery id of the previous page (an unknown one: from the start)."""
    q = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
    if after:
        prev = s.get(WebhookDelivery, after)
        if prev is not None and prev.endpoint_id == endpoint_id:
            q = q.where(
                or_(
                    WebhookDelivery.created_at < prev.created_at,
                    and_(WebhookDelivery.created_at == prev.created_at, WebhookDelivery.id < prev.id),
                )
            )
    q = q.order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc()).limit(limit)
    return list(s.scalars(q))


def enqueue_job_event(s: Session, job: Job, status: str) -> int:
    """One delivery per endpoint of the job's tenant that subscribes to ``fine_tuning.job.<status>``, in
    the caller's transaction (the one that sets the status); returns how many."""
    event_type = f"fine_tuning.job.{status}"
    endpoints = [
        ep
        for ep in s.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == job.tenant_id))
        if event_type in (ep.events or ())
    ]
    if not endpoints:
        return 0
    event_id, payload = event_payload(event_type, job.id)
    now = _now()
    for ep in endpoints:
        s.add(
            WebhookDelivery(
                endpoint_id=ep.id,
                tenant_id=job.tenant_id,
                job_id=job.id,
                event_id=event_id,
                event_type=event_type,
                payload=payload,
                status="pending",
                attempts=0,
                next_attempt_at=now,
                history=[],
            )
        )
    return len(endpoints)


def claim_due(
    s: Session, limit: int, hold_s: float, busy_tenants: frozenset[str] = frozenset(), per_tenant: int = 1
) -> list[Due]:
    """Up to ``limit`` pending deliveries whose time has come, oldest first but at most ``per_tenant`` of
    each tenant and none of ``busy_tenants`` (those the caller is sending to already): one tenant's backlog
    or slow receivers cannot hold the sender's threads. Each is held for ``hold_s`` (its next attempt
    moved past the send): a concurrent sender skips it, and one whose sender died is sent again once the
    hold has passed (at least once; receivers deduplicate on ``webhook-id``)."""
    if s.get_bind().dialect.name == "sqlite":  # the writer's lock first (no FOR UPDATE): senders claim in turn
        s.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == "")
            .values(status=WebhookDelivery.status)
            .execution_options(synchronize_session=False)
        )
    now = _now()
    order = (WebhookDelivery.next_attempt_at, WebhookDelivery.id)
    ranked = (
        select(
            WebhookDelivery.id,
            func.row_number().over(partition_by=WebhookDelivery.tenant_id, order_by=order).label("rank"),
        )
        .where(
            WebhookDelivery.status == "pending",
            WebhookDelivery.next_attempt_at <= now,
            WebhookDelivery.tenant_id.not_in(busy_tenants),
        )
        .subquery()
    )
    q = (
        select(WebhookDelivery)
        .where(WebhookDelivery.id.in_(select(ranked.c.id).where(ranked.c.rank <= per_tenant)))
        .order_by(*order)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    rows = list(s.scalars(q))
    if not rows:
        return []
    eps = {
        e.id: e for e in s.scalars(select(WebhookEndpoint).where(WebhookEndpoint.id.in_({r.endpoint_id for r in rows})))
    }
    for r in rows:
        r.next_attempt_at = now + timedelta(seconds=hold_s)
    return [
        Due(r.id, eps[r.endpoint_id].url, signing_secrets(eps[r.endpoint_id], now), r.payload, r.attempts, r.tenant_id)
        for r in rows
    ]


def record_attempt(
    s: Session,
    delivery_id: str,
    policy: RetryPolicy,
    *,
    status_code: int | None,
    error: str | None,
    retry: bool,
    duration_s: float,
) -> WebhookDelivery | None:
    """Record one attempt: a 2xx (``error`` None) delivers; else, when ``retry`` and attempts are left,
    the next attempt is scheduled with backoff, otherwise the delivery has failed. None when the delivery
    was deleted meanwhile."""
    row = s.get(WebhookDelivery, delivery_id, with_for_update=True)
    if row is None or row.status != "pending":
        return None
    now = _now()
    row.attempts += 1
    row.last_status_code, row.last_error = status_code, error
    entry = {
        "at": int(now.timestamp()),
        "status_code": status_code,
        "error": error,
        "duration_ms": int(duration_s * 1000),
    }
    row.history = [*(row.history or []), entry]
    if error is None:
        row.status, row.next_attempt_at, row.finished_at = "delivered", None, now
    elif retry and row.attempts < policy.max_attempts:
        row.next_attempt_at = now + timedelta(seconds=policy.delay(row.attempts))
    else:
        row.status, row.next_attempt_at, row.finished_at = "failed", None, now
    return row
