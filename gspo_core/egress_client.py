"""Outbound HTTP to user-given URLs over httpx, each connection pinned to an address the egress policy checked.

Anything that fetches a URL a tenant chose (graders, webhooks, agent tools) goes through :class:`EgressClient`.
A host is resolved once per connection, its refused addresses dropped (:class:`~gspo_core.egress.EgressPolicy`),
and the connection is made to a checked address itself (httpcore network backend), so a DNS answer that
changes between check and connect cannot reach the inside. TLS still verifies the URL's hostname (SNI and
certificate). Redirects are followed here, one checked hop at a time; credentials and the caller's own headers
are dropped when a hop leaves the original origin.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import httpcore
import httpx

from gspo_core.egress import EgressPolicy, EgressRefused, Resolver, normal_host
from gspo_core.urls import redact_userinfo


class EgressError(Exception):
    """The request failed; the message is safe to show the tenant (no remote body, no port state)."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(redact_userinfo(message))  # a redirect's message quotes the URL


class _PinnedBackend(httpcore.NetworkBackend):
    """Connects to the checked addresses of the requested host, never to the name itself."""

    def __init__(self, policy: EgressPolicy, resolver: Resolver | None) -> None:
        self.policy, self.resolver = policy, resolver
        self._plain = httpcore.SyncBackend()

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        failures: list[httpcore.ConnectError] = []
        # checked_addresses returns at least one address (it raises EgressRefused instead of an empty list).
        for address in self.policy.checked_addresses(host, port, self.resolver):
            try:
                return self._plain.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:
                failures.append(exc)
        raise failures[-1]

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise EgressRefused("unix sockets are not reachable")

    def sleep(self, seconds: float) -> None:
        self._plain.sleep(seconds)


#: httpcore's exceptions as httpx raises them (most specific first).
_EXC = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


def _as_httpx(exc: Exception) -> Exception:
    for core, ours in _EXC:
        if isinstance(exc, core):
            return ours(str(exc))
    return exc


class _Body(httpx.SyncByteStream):
    def __init__(self, stream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except httpcore.TimeoutException as exc:
            raise _as_httpx(exc) from None
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise _as_httpx(exc) from None

    def close(self) -> None:
        self._stream.close()


class PinnedTransport(httpx.BaseTransport):
    """An httpx transport whose connections go only to checked, pinned addresses (see module doc)."""

    def __init__(
        self,
        policy: EgressPolicy,
        verify: ssl.SSLContext | None = None,
        max_connections: int = 64,
        resolver: Resolver | None = None,
    ) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=verify or ssl.create_default_context(),
            max_connections=max_connections,
            network_backend=_PinnedBackend(policy, resolver),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        core = httpcore.Request(
            method=request.method,
            headers=request.headers.raw,
            content=request.stream,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            extensions=request.extensions,
        )
        try:
            resp = self._pool.handle_request(core)
        except (
            httpcore.TimeoutException,
            httpcore.NetworkError,
            httpcore.ProtocolError,
            httpcore.UnsupportedProtocol,
        ) as exc:
            raise _as_httpx(exc) from None
        return httpx.Response(
            status_code=resp.status, headers=resp.headers, stream=_Body(resp.stream), extensions=resp.extensions
        )

    def close(self) -> None:
        self._pool.close()


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return url.scheme, normal_host(url.host), url.port


class EgressClient:
    """A thread-safe HTTP client for tenant-given URLs: :class:`PinnedTransport` underneath, at most
    ``max_redirects`` redirects (each hop checked, to http(s) only), ``Authorization`` and the
    caller's ``headers`` dropped once a hop leaves the first origin, at most ``max_body`` bytes read.
    Every failure is an :class:`EgressRefused` or an :class:`EgressError` whose text tells neither
    the remote body nor whether a port was open."""

    def __init__(
        self,
        policy: EgressPolicy,
        timeout: float,
        headers: dict[str, str] | None = None,
        verify: ssl.SSLContext | None = None,
        max_redirects: int = 3,
        max_body: int = 1 << 20,
        max_connections: int = 64,
        resolver: Resolver | None = None,
    ) -> None:
        self.timeout, self.headers = timeout, dict(headers or {})
        self.max_redirects, self.max_body = max_redirects, max_body
        self._client = httpx.Client(
            transport=PinnedTransport(policy, verify, max_connections, resolver),
            timeout=timeout,
            follow_redirects=False,
            trust_env=False,
        )

    def request(self, method: str, url: str, json: object = None) -> tuple[int, bytes]:
        """``(status, body)`` of the final answer after redirects."""
        req = self._client.build_request(method, url, json=json, headers=self.headers)
        first = _origin(req.url)
        for _ in range(self.max_redirects + 1):
            status, body, nxt = self._send(req)
            if nxt is None:
                return status, body
            if nxt.url.scheme not in ("http", "https"):
                raise EgressError("http_error", f"{url} redirected to a {nxt.url.scheme or 'relative'} URL")
            if _origin(nxt.url) != first:
                for name in ("Authorization", *self.headers):
                    nxt.headers.pop(name, None)
            req = nxt
        raise EgressError("http_error", f"{url} redirected more than {self.max_redirects} times")

    def _send(self, req: httpx.Request) -> tuple[int, bytes, httpx.Request | None]:
        where = f"{req.url.scheme}://{req.url.netloc.decode('ascii', 'replace')}"
        try:
            resp = self._client.send(req, stream=True)
            try:
                if resp.is_redirect:
                    return resp.status_code, b"", resp.next_request
                body = bytearray()
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > self.max_body:
                        raise EgressError("invalid_output", f"answer from {where} larger than {self.max_body} bytes")
                return resp.status_code, bytes(body), None
            finally:
                resp.close()
        except httpx.TimeoutException:
            raise EgressError("timeout", f"no answer from {where} within {self.timeout:g} s") from None
        except httpx.HTTPError:  # connection refused, reset, TLS failure, not HTTP: one text for all
            raise EgressError("http_error", f"could not get an answer from {where}") from None

    def close(self) -> None:
        self._client.close()
