"""Pure ASGI middleware: body size limit on the byte stream, in-flight bound, request metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from prometheus_client import Counter, Histogram
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once the body passes the limit. An HTTPException so that FastAPI's
    body parser re-raises it as it is (it turns any other exception into a 400)."""

    error_type = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes")


class BodyLimitMiddleware:
    """Refuse bodies over ``limit_for(path)`` bytes with 413, never buffering past the limit.

    A declared Content-Length over the limit is refused before reading; a chunked body (no length)
    is counted as it arrives, so a multipart upload cannot spool an unbounded file to disk first.
    """

    def __init__(
        self, app: ASGIApp, limit_for: Callable[[str], int], rate_for: Callable[[str], float] = lambda _: 0.0
    ) -> None:
        self.app, self.limit_for, self.rate_for = app, limit_for, rate_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _send_413(send, limit)
            return
        received, started = 0, False
        # Bytes a second this body is read at (0: as fast as it comes): reading slower holds the client back
        # through TCP, so one tenant's uploads cannot take the event loop's time for their parsing.
        rate, t0 = self.rate_for(scope["path"]), time.monotonic()

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
                if rate and (ahead := t0 + received / rate - time.monotonic()) > 0:
                    await asyncio.sleep(ahead)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await _send_413(send, limit)


async def _send_413(send: Send, limit: int) -> None:
    payload = json.dumps(errors.body(BodyTooLarge.error_type, f"request body exceeds {limit} bytes")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def _ungated(method: str, path: str) -> bool:
    """Event streams, dry runs and uploads: bounded per tenant and per process by api.limits, and
    they hold no pooled connection while they last (they would hold a slot here for minutes)."""
    return (
        path == "/healthz"
        or path.endswith("/events")
        or (method == "POST" and path in ("/v1/rewards/run", "/v1/files"))
    )


class MetricsMiddleware:
    """Counts and times requests by route template, and bounds requests in flight.

    Pure ASGI (no per-request task or body re-streaming as with ``@app.middleware``): it is on
    every request's path, and the load test polls at hundreds of requests per second.
    """

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram, max_in_flight: int = 32) -> None:
        self.app, self.requests, self.latency = app, requests, latency
        self.gate = asyncio.Semaphore(max_in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 500
        # Bound requests in flight below the DB pool (a request holds its connection while it waits
        # for a worker thread). Long calls with caps of their own skip it, as does /healthz, which
        # must answer at once whatever else is in flight.
        gated = not _ungated(scope["method"], scope["path"])
        if gated:
            await self.gate.acquire()
        held = gated

        async def observing_send(message: Message) -> None:
            nonlocal status, held
            if message["type"] == "http.response.start":
                status = message["status"]
                if held:  # a long download must not keep a slot while its body streams
                    self.gate.release()
                    held = False
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        finally:
            if held:
                self.gate.release()
            route = getattr(scope.get("route"), "path", "unmatched")
            self.requests.labels(scope["method"], route, str(status)).inc()
            self.latency.labels(scope["method"], route).observe(time.perf_counter() - t0)
