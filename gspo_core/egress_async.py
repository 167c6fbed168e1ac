"""The egress policy for asyncio clients built on httpx2 (the MCP SDK's): connections pinned to checked addresses.

The same rule as :class:`gspo_core.egress_client.PinnedTransport`, for the async stack: every connection resolves its
host once, drops the refused addresses (`EgressPolicy.checked_addresses`) and connects to a checked address
itself, so a DNS answer that changes between check and connect cannot reach the inside. It plugs into
``httpx2.AsyncClient(transport=...)`` (httpx2's transport API) over an httpcore2 pool whose network backend is
ours (httpcore2's backend API).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator

import anyio
import httpcore
import httpcore2
import httpx2

from gspo_core.egress import EgressPolicy, EgressRefused, Resolver


class EgressRefusedError(httpx2.ConnectError):
    """A connection the egress policy refused, as the httpx2 error its callers handle."""


class _PinnedAsyncBackend(httpcore2.AsyncNetworkBackend):
    """Connects to the checked addresses of the requested host, never to the name itself."""

    def __init__(self, policy: EgressPolicy, resolver: Resolver | None) -> None:
        self.policy, self.resolver = policy, resolver
        self._plain = httpcore2.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:  # the system resolver blocks: off the event loop
            addresses = await anyio.to_thread.run_sync(self.policy.checked_addresses, host, port, self.resolver)
        except EgressRefused as exc:
            raise EgressRefusedError(str(exc)) from None
        except httpcore.ConnectError as exc:
            raise httpcore2.ConnectError(str(exc)) from None
        failures: list[Exception] = []
        for address in addresses:
            try:
                return await self._plain.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore2.ConnectError as exc:
                failures.append(exc)
        raise failures[-1]

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise EgressRefusedError("unix sockets are not reachable")

    async def sleep(self, seconds: float) -> None:
        await self._plain.sleep(seconds)


def _as_httpx2(exc: Exception) -> Exception:
    """httpcore2's exception as the httpx2 one of the same name (httpx2's callers catch those)."""
    kind = getattr(httpx2, type(exc).__name__, None)
    if isinstance(kind, type) and issubclass(kind, httpx2.TransportError):
        return kind(str(exc))
    return httpx2.TransportError(str(exc))


_CORE_ERRORS = (
    httpcore2.TimeoutException,
    httpcore2.NetworkError,
    httpcore2.ProtocolError,
    httpcore2.UnsupportedProtocol,
)


class _Body(httpx2.AsyncByteStream):
    def __init__(self, stream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except _CORE_ERRORS as exc:
            raise _as_httpx2(exc) from None

    async def aclose(self) -> None:
        await self._stream.aclose()


class PinnedAsyncTransport(httpx2.AsyncBaseTransport):
    """An httpx2 transport whose connections go only to checked, pinned addresses."""

    def __init__(
        self,
        policy: EgressPolicy,
        verify: ssl.SSLContext | None = None,
        max_connections: int = 64,
        resolver: Resolver | None = None,
    ) -> None:
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=verify or ssl.create_default_context(),
            max_connections=max_connections,
            network_backend=_PinnedAsyncBackend(policy, resolver),
        )

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        core = httpcore2.Request(
            method=request.method,
            headers=request.headers.raw,
            content=request.stream,
            url=httpcore2.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            extensions=request.extensions,
        )
        try:
            resp = await self._pool.handle_async_request(core)
        except _CORE_ERRORS as exc:
            raise _as_httpx2(exc) from None
        return httpx2.Response(
            status_code=resp.status, headers=resp.headers, stream=_Body(resp.stream), extensions=resp.extensions
        )

    async def aclose(self) -> None:
        await self._pool.aclose()
