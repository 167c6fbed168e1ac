"""A small HTTP/1.1 server on asyncio with bounded costs, for the agent endpoint (`gspo_core.agents.remote`).

It may be reachable beyond loopback (``GSPO_AGENT_ENDPOINT_HOST``), so nothing a client sends can hold more
than it is allowed: a slow socket costs one coroutine and a bounded buffer, never a thread; a request's head
and body must both arrive within one deadline (not each read); a body is read only once the handler has
accepted the request's head (the session exists), and only up to its declared, bounded ``Content-Length``;
connections are capped per server (per job) and per process, the oldest one still sending its request
giving way to a new one, so slow sockets cannot lock out an agent whose request arrives at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

#: ``(status, JSON body)``.
Answer = tuple[int, dict]


@dataclass(frozen=True)
class Limits:
    """``max_body``: the largest ``Content-Length`` accepted (413 beyond); ``max_head``: request line and
    headers (431 beyond); ``request_deadline_s``: from when a connection waits for a request (accepted, or
    its previous answer sent) until that request's whole body is in, else the connection closes (408 when
    part of it came); ``max_connections``: open connections of one server; ``max_connections_total``: of all
    servers in the process."""

    max_body: int = 8 << 20
    max_head: int = 16 << 10
    request_deadline_s: float = 30.0
    max_connections: int = 256
    max_connections_total: int = 1024


@dataclass(frozen=True)
class Request:
    """A request's head: ``headers`` with lower-cased names."""

    method: str
    path: str
    headers: dict[str, str]


class Handler(Protocol):
    """``head``: the answer to give without reading the body (404 for an unknown session, ...), or None to
    read it; ``body``: the answer to a request whose head was accepted and whose body was read."""

    def head(self, request: Request) -> Answer | None: ...

    def body(self, request: Request, body: bytes) -> Awaitable[Answer]: ...


class _Refused(Exception):
    """The request cannot be read on: answered with ``answer`` (None: nothing) and the connection closed."""

    def __init__(self, answer: Answer | None) -> None:
        super().__init__(answer)
        self.answer = answer


class _Total:
    """Open connections of every server in the process (servers run on their own loops' threads)."""

    def __init__(self) -> None:
        self.lock, self.open = threading.Lock(), 0

    def take(self, cap: int) -> bool:
        with self.lock:
            if self.open >= cap:
                return False
            self.open += 1
            return True

    def give(self) -> None:
        with self.lock:
            self.open -= 1


TOTAL = _Total()


@dataclass
class _Connection:
    #: When it began waiting for its current request; None while its request is being answered.
    reading_since: float | None


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


class BoundedServer:
    """Serves ``handler`` on ``host:port`` (0: a free port) from a thread of its own running an event loop;
    ``address``: where it listens. ``close`` ends every connection."""

    def __init__(self, handler: Handler, host: str, port: int, limits: Limits, name: str = "http") -> None:
        self.handler, self.limits = handler, limits
        self.connections: dict[asyncio.Task, _Connection] = {}
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, host, port, limit=limits.max_head, backlog=128)
        )
        self.address: tuple[str, int] = self.server.sockets[0].getsockname()[:2]
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the server's loop (from any thread); nothing once the server is closed."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = list(self.connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _admit(self, task: asyncio.Task) -> bool:
        """Room for one more connection: the oldest one still sending its request is dropped when this server
        or the process is at its cap; none to drop, the new one is refused."""
        while len(self.connections) >= self.limits.max_connections or not TOTAL.take(self.limits.max_connections_total):
            reading = [(c.reading_since, t) for t, c in self.connections.items() if c.reading_since is not None]
            if not reading:
                return False
            oldest = min(reading, key=lambda pair: pair[0])[1]
            self._forget(oldest)
            oldest.cancel()
        self.connections[task] = _Connection(time.monotonic())
        return True

    def _forget(self, task: asyncio.Task) -> None:
        if self.connections.pop(task, None) is not None:
            TOTAL.give()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if not self._admit(task):
            writer.close()
            return
        conn = self.connections[task]
        try:
            while await self._one(reader, writer, conn):
                pass
        except (asyncio.CancelledError, ConnectionError, TimeoutError):
            pass
        finally:
            self._forget(task)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Connection) -> bool:
        """Read and answer one request; True when the connection may carry another."""
        conn.reading_since, started = time.monotonic(), False
        try:
            async with asyncio.timeout(self.limits.request_deadline_s):
                first = await reader.read(1)
                if not first:
                    return False  # closed between requests
                started = True
                request, keep = await self._head(first, reader)
                answer = self.handler.head(request)
                if answer is None:
                    body = await self._body(reader, writer, request)
                else:
                    keep = keep and _no_body(request)  # a body left unread ends the connection
        except _Refused as refused:
            if refused.answer is not None:
                await self._send(writer, refused.answer, keep=False)
            return False
        except TimeoutError:
            if started:  # an idle connection is closed silently, a slow request is told why
                await self._send(writer, (408, _error("the request did not arrive in time")), keep=False)
            return False
        conn.reading_since = None  # a whole request: its answer may take the agent's timeout
        if answer is None:
            try:
                answer = await self.handler.body(request, body)
            except Exception:  # the handler's own failure is this request's 500, not the connection's silence
                answer, keep = (500, _error("the request could not be handled")), False
        await self._send(writer, answer, keep)
        return keep

    async def _head(self, first: bytes, reader: asyncio.StreamReader) -> tuple[Request, bool]:
        """The request line and headers (``first``: the byte already read); whether it keeps the connection."""
        try:
            raw = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            raise _Refused(None) from None  # closed before a whole head
        except asyncio.LimitOverrunError:
            raise _Refused((431, _error(f"the request's head is larger than {self.limits.max_head} bytes"))) from None
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Refused((400, _error("not an HTTP/1.x request line")))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            key = name.strip().lower()
            if not sep or not key or (key in headers and key in ("content-length", "host")):
                raise _Refused((400, _error(f"a malformed or repeated header: {name[:64]!r}")))
            headers[key] = value.strip()
        keep = parts[2] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        return Request(parts[0], parts[1], headers), keep

    async def _body(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: Request) -> bytes:
        """The body, ``Content-Length`` bytes of it: required (411), a whole number (400), bounded (413)."""
        if "transfer-encoding" in request.headers:
            raise _Refused((411, _error("Transfer-Encoding is not supported: send Content-Length")))
        raw = request.headers.get("content-length")
        if raw is None:
            raise _Refused((411, _error("Content-Length is required")))
        if not (raw.isascii() and raw.isdigit()):  # ASCII digits only: no sign, no spaces, no "1e3"
            raise _Refused((400, _error(f"Content-Length: {raw[:32]!r} is not a number of bytes")))
        size = int(raw[:20])
        if len(raw) > 20 or size > self.limits.max_body:
            raise _Refused((413, _error(f"the request is larger than {self.limits.max_body} bytes")))
        if request.headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            return await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            raise _Refused(None) from None

    async def _send(self, writer: asyncio.StreamWriter, answer: Answer, keep: bool) -> None:
        status, obj = answer
        data = json.dumps(obj).encode()
        head = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
            *([] if keep else ["Connection: close"]),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        # A client that does not read its answer keeps it no longer than a request may take to arrive.
        await asyncio.wait_for(writer.drain(), self.limits.request_deadline_s)


def _no_body(request: Request) -> bool:
    """Whether the request came without a body (then its connection may carry another request)."""
    return request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers
