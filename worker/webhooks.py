"""Sends due webhook deliveries: signed per Standard Webhooks, through the egress policy, retried with backoff."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime

import httpx

from gspo_core import delivery
from gspo_core.egress import EgressPolicy
from store import webhooks
from store.settings import Settings
from store.webhooks import Due, RetryPolicy
from worker.context import get_db

log = logging.getLogger(__name__)
#: How many deliveries are sent at once (one tenant's at a time).
SEND_THREADS = 4


def make_client(settings: Settings) -> httpx.Client:
    """The sender's client: the operator's egress policy (GSPO_EGRESS_ALLOW), redirects not followed."""
    policy = EgressPolicy(settings.grader_policy()["egress_allow"])
    return delivery.make_client(policy, settings.webhook_timeout_seconds, SEND_THREADS)


def post(client: httpx.Client, due: Due) -> tuple[int | None, str | None, bool]:
    """One signed attempt (Standard Webhooks' headers, the same webhook-id on every attempt)."""
    headers = webhooks.signed_headers(due.id, due.secrets, due.payload, datetime.now(UTC))
    return delivery.post(client, due.url, due.payload.encode(), headers)


def _attempt(settings: Settings, client: httpx.Client, due: Due, policy: RetryPolicy) -> None:
    t0 = time.monotonic()
    try:
        code, error, retry = post(client, due)
    except Exception as exc:  # a bug or a bad stored secret: counted as an attempt, so it cannot loop forever
        log.warning("webhooks: delivery %s: %s", due.id, exc)
        code, error, retry = None, "could not send (internal error)", True
    with get_db(settings).session() as s:
        webhooks.record_attempt(
            s, due.id, policy, status_code=code, error=error, retry=retry, duration_s=time.monotonic() - t0
        )


class Sender:
    """Sends claimed deliveries on ``threads`` threads, at most one per tenant at a time: a tenant's slow or
    dead receivers hold one thread (for at most the timeout), never the others' deliveries."""

    def __init__(self, settings: Settings, client: httpx.Client, threads: int = SEND_THREADS) -> None:
        self.settings, self.client, self.threads = settings, client, threads
        self.policy = RetryPolicy(
            settings.webhook_max_attempts, settings.webhook_retry_base_seconds, settings.webhook_retry_max_seconds
        )
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="webhook-send")
        self.lock = threading.Lock()
        self.busy: dict[str, Future] = {}  # tenant -> its delivery being sent
        self.done = threading.Event()  # set whenever a send ends: a thread is free again

    def fill(self) -> int:
        """Claim due deliveries for the free threads, of tenants not being sent to, and start sending them."""
        with self.lock:
            free, busy = self.threads - len(self.busy), frozenset(self.busy)
        if free <= 0:
            return 0
        with get_db(self.settings).session() as s:  # held past one send (at most a timeout)
            due = webhooks.claim_due(s, free, self.settings.webhook_timeout_seconds + 30, busy)
        for d in due:
            with self.lock:
                self.busy[d.tenant_id] = self.pool.submit(self._send, d)
        return len(due)

    def _send(self, due: Due) -> None:
        try:
            _attempt(self.settings, self.client, due, self.policy)
        finally:
            with self.lock:
                del self.busy[due.tenant_id]
            self.done.set()

    def drain(self) -> None:
        with self.lock:
            running = list(self.busy.values())
        wait(running)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def send_due(settings: Settings, client: httpx.Client) -> int:
    """One round: claim what is due (one delivery per tenant), send it, wait; returns how many were attempted."""
    sender = Sender(settings, client)
    try:
        n = sender.fill()
        sender.drain()
        return n
    finally:
        sender.close()


def start_sender_thread(settings: Settings, stop: threading.Event | None = None) -> threading.Thread:
    """Every worker's main process sends (like the reaper), `gspo up`'s embedded worker included: it claims
    more as soon as a send ends, and polls for newly due deliveries every GSPO_WEBHOOK_POLL_SECONDS."""
    stop = stop or threading.Event()

    def loop() -> None:
        client = make_client(settings)
        sender = Sender(settings, client)
        while not stop.is_set():
            sender.done.clear()  # before claiming: a send that ends from here on wakes the wait below
            try:
                sender.fill()
            except Exception as exc:  # database down: try again next round
                log.warning("webhooks: %s", exc)
            sender.done.wait(settings.webhook_poll_seconds)
        sender.close()
        client.close()

    th = threading.Thread(target=loop, name="gspo-webhooks", daemon=True)
    th.start()
    return th
