"""Sends due webhook deliveries: signed per Standard Webhooks, through the egress policy, retried with backoff."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx
from standardwebhooks import Webhook

from gspo_core.egress import EgressPolicy, EgressRefused, PinnedTransport
from store import webhooks
from store.settings import Settings
from store.webhooks import Due, RetryPolicy
from worker.context import get_db

log = logging.getLogger(__name__)
#: Deliveries claimed per round, and how many are sent at once (a slow endpoint holds one thread only).
BATCH, SEND_THREADS = 32, 4


def make_client(settings: Settings) -> httpx.Client:
    """An HTTP client whose connections go only where the egress policy allows (pinned addresses, the
    operator's GSPO_EGRESS_ALLOW), redirects not followed: a signed body goes to the registered URL only."""
    policy = EgressPolicy(settings.grader_policy()["egress_allow"])
    return httpx.Client(
        transport=PinnedTransport(policy, max_connections=SEND_THREADS),
        timeout=settings.webhook_timeout_seconds,
        follow_redirects=False,
        trust_env=False,
    )


def signed_headers(due: Due, at: datetime) -> dict[str, str]:
    """Standard Webhooks' headers: the delivery's id (the same on every attempt), the time, the signature."""
    return {
        "webhook-id": due.id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Webhook(due.secret).sign(due.id, at, due.payload),
        "content-type": "application/json",
        "user-agent": "gspo-webhooks/1",
    }


def post(client: httpx.Client, due: Due, timeout: float) -> tuple[int | None, str | None, bool]:
    """One attempt: ``(status code, error text or None on a 2xx, whether to retry)``. The answer's body is
    never read, so none of it can reach the tenant; errors say what failed, not what the remote said."""
    try:
        headers = signed_headers(due, datetime.now(UTC))
        with client.stream("POST", due.url, content=due.payload.encode(), headers=headers) as resp:
            code = resp.status_code
    except EgressRefused as exc:
        return None, f"refused by the egress policy: {exc}", False
    except httpx.InvalidURL:
        return None, "not a valid URL", False
    except httpx.TimeoutException:
        return None, f"no answer within {timeout:g} s", True
    except httpx.HTTPError:  # refused, reset, TLS failure, not HTTP: one text for all (no port scanning)
        return None, "could not get an answer (connection or protocol error)", True
    if 200 <= code < 300:
        return code, None, False
    if 300 <= code < 400:
        return code, f"HTTP {code}: redirects are not followed", False
    return code, f"HTTP {code}", code >= 500 or code in (408, 429)


def _attempt(settings: Settings, client: httpx.Client, due: Due, policy: RetryPolicy) -> None:
    t0 = time.monotonic()
    try:
        code, error, retry = post(client, due, settings.webhook_timeout_seconds)
    except Exception as exc:  # a bug or a bad stored secret: counted as an attempt, so it cannot loop forever
        log.warning("webhooks: delivery %s: %s", due.id, exc)
        code, error, retry = None, "could not send (internal error)", True
    with get_db(settings).session() as s:
        webhooks.record_attempt(
            s, due.id, policy, status_code=code, error=error, retry=retry, duration_s=time.monotonic() - t0
        )


def send_due(settings: Settings, client: httpx.Client) -> int:
    """Claim the deliveries whose time has come and send them; returns how many were attempted."""
    policy = RetryPolicy(
        settings.webhook_max_attempts, settings.webhook_retry_base_seconds, settings.webhook_retry_max_seconds
    )
    # Held past the longest this round can take (BATCH / SEND_THREADS sends in a row, each at most a timeout).
    hold = settings.webhook_timeout_seconds * (BATCH // SEND_THREADS + 1) + 30
    with get_db(settings).session() as s:
        due = webhooks.claim_due(s, BATCH, hold)
    if due:
        with ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="webhook-send") as pool:
            list(pool.map(lambda d: _attempt(settings, client, d, policy), due))
    return len(due)


def start_sender_thread(settings: Settings, stop: threading.Event | None = None) -> threading.Thread:
    """Every worker's main process sends (like the reaper), `gspo up`'s embedded worker included."""
    stop = stop or threading.Event()

    def loop() -> None:
        client = make_client(settings)
        while not stop.wait(settings.webhook_poll_seconds):
            try:
                while send_due(settings, client) == BATCH and not stop.is_set():
                    pass  # a full batch: more may be due now
            except Exception as exc:  # database down: try again next round
                log.warning("webhooks: %s", exc)
        client.close()

    th = threading.Thread(target=loop, name="gspo-webhooks", daemon=True)
    th.start()
    return th
