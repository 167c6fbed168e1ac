"""The egress policy for user-given URLs: which addresses, URLs and request headers a tenant may reach or send.

Every address a tenant's URL resolves to is checked (loopback, private, link-local, multicast, reserved,
unspecified, IPv4 embedded in IPv6, cloud metadata) against the operator's allow-list (hosts or CIDRs),
which opens specific internal targets. The connections themselves are pinned to the checked addresses by
:mod:`gspo_core.egress_client` (sync httpx) and :mod:`gspo_core.egress_async` (the MCP SDK's httpx2).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``resolver(host, port) -> [address, ...]`` (the default asks the system's resolver).
Resolver = Callable[[str, int], Sequence[str]]

#: Cloud metadata and host-agent endpoints (AWS IMDS v4/v6 and ECS, GCP, Azure wireserver, Alibaba).
METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "169.254.170.2",
        "169.254.169.123",
        "fd00:ec2::254",
        "168.63.129.16",
        "100.100.100.200",
    )
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
SIIT = ipaddress.ip_network("::ffff:0:0:0/96")
#: Names that mean this host without asking DNS (RFC 6761).
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
#: Request headers a tenant may not set: they steer routing or framing, not the endpoint's logic.
FORBIDDEN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "proxy-authenticate",
        "expect",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-real-ip",
    }
)
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_IPV4_SPELLING = re.compile(r"^[0-9a-fA-FxX.]+$")


class EgressRefused(Exception):
    """The URL's host (or a redirect's) is one this service may not connect to; nothing was sent."""


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, SIIT, 6to4, Teredo, NAT64, compatible)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in SIIT or ip in NAT64 or (int(ip) >> 32 == 0 and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def address_refusal(ip: IPAddress) -> str | None:
    """Why ``ip`` may not be reached without the operator's allow-list (None: it is public)."""
    if ip in METADATA:
        return "a cloud metadata address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "a scoped (link-local) address"
        inner = _embedded_v4(ip)
        if inner is not None and (why := address_refusal(inner)):
            return why
        if ip in NAT64:  # DNS64 names a public IPv4 host this way: its verdict is the IPv4 address's
            return None
        if ip in NAT64_LOCAL:
            return "a local NAT64 address"
    for prop, words in (
        ("is_unspecified", "an unspecified"),
        ("is_loopback", "a loopback"),
        ("is_link_local", "a link-local"),
        ("is_multicast", "a multicast"),
        ("is_private", "a private"),
        ("is_reserved", "a reserved"),
        ("is_site_local", "a site-local"),
    ):
        if getattr(ip, prop, False):
            return f"{words} address"
    if not ip.is_global:
        return "a non-public address"
    return None


def literal_address(host: str) -> IPAddress | None:
    """The address a URL host spells literally, in any form a resolver accepts (``127.1``,
    ``2130706433``, ``0x7f000001``, ``0177.0.0.1``, ``[::ffff:127.0.0.1]``); None for a name."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _IPV4_SPELLING.match(host) and any(c.isdigit() for c in host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def normal_host(host: str) -> str:
    """A host as compared: no brackets, no trailing dot, lower case."""
    return host.strip("[]").rstrip(".").lower()


def _is_loopback_name(host: str) -> bool:
    host = normal_host(host)
    return host in LOOPBACK_NAMES or host.endswith(".localhost")


class EgressPolicy:
    """The operator's allow-list (hostnames, addresses or CIDRs) over the built-in refusals."""

    def __init__(self, allow: Iterable[str] = ()) -> None:
        self.names: set[str] = set()
        self.nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allow:
            entry = entry.strip()
            if not entry:
                continue
            try:
                self.nets.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.names.add(normal_host(entry))

    def _net_allows(self, ip: IPAddress) -> bool:
        inner = _embedded_v4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
        return any(ip in net or (inner is not None and inner in net) for net in self.nets)

    def refusal(self, ip: IPAddress, host: str = "") -> str | None:
        """Why ``ip`` (reached through ``host``) is refused; None when allowed. Metadata addresses
        need the address itself on the allow-list (a CIDR or hostname entry does not open them)."""
        why = address_refusal(ip)
        if why is None:
            return None
        exact = any(net.num_addresses == 1 and ip in net for net in self.nets)
        if ip in METADATA:
            return None if exact else why
        if normal_host(host) in self.names or self._net_allows(ip):
            return None
        return why

    def literal_refusal(self, url: str) -> str | None:
        """Checked when a spec is built: why the URL's host, when it is an address literal or a
        loopback name, is refused (None for allowed literals and for names, which are checked when
        resolved)."""
        host = normal_host(httpx.URL(url).host)
        ip = literal_address(host)
        if ip is not None:
            why = self.refusal(ip, host)
            return f"{host} is {why}" if why else None
        if _is_loopback_name(host):
            loop = ipaddress.ip_address("127.0.0.1")
            return None if self.refusal(loop, host) is None else f"{host} is a loopback address"
        return None

    def checked_addresses(self, host: str, port: int, resolver: Resolver | None = None) -> list[str]:
        """``host``'s addresses that may be reached, in resolver order; raises EgressRefused when
        none may (addresses that are refused are left out, never connected to)."""
        literal = literal_address(host)
        if literal is not None:
            addrs = [str(literal)]
        elif _is_loopback_name(host):  # RFC 6761: this host, whatever a resolver would say
            addrs = ["127.0.0.1"]
        else:
            try:
                addrs = list((resolver or system_resolver)(host, port))
            except OSError:
                raise httpcore.ConnectError(f"could not resolve {host}") from None
        ok, reasons = [], []
        for a in addrs:
            ip = ipaddress.ip_address(a)
            why = self.refusal(ip, host)
            if why is None:
                ok.append(str(ip))
            else:
                reasons.append(why)
        if not ok:
            raise EgressRefused(f"{host} resolves to {reasons[0] if reasons else 'no address'}")
        return ok


class UserUrlError(ValueError):
    """A URL a tenant gave that the service will not use: not an http(s) URL that httpx can send to (a host
    such as ``0177.0.0.1`` it refuses to parse), or, ``refused``, one whose host the egress policy refuses."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def check_user_url(url: object, allow: Iterable[str] = ()) -> str:
    """``url`` when it is an http(s) URL whose host is no refused address literal (in any spelling) or
    loopback name under the allow-list ``allow``; raises :class:`UserUrlError`. The one check of every
    URL a tenant gives (graders, tools, MCP servers, agents, webhooks). Other names are checked when resolved."""
    if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
        raise UserUrlError("must be an http(s) URL")
    try:
        why = EgressPolicy(allow).literal_refusal(url)
    except (ValueError, httpx.InvalidURL) as exc:  # InvalidURL is no ValueError: "http://[::1", "http://0177.0.0.1"
        raise UserUrlError(f"must be an http(s) URL ({exc})") from None
    if why:
        raise UserUrlError(f"not reachable from this service: {why}", refused=True)
    return url


def system_resolver(host: str, port: int) -> list[str]:
    """The system resolver's addresses for ``host`` (TCP), first-seen order, duplicates dropped."""
    out: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = sockaddr[0]  # an IPv4 or IPv6 address, as text
        if isinstance(address, str) and address not in out:
            out.append(address)
    return out


def header_refusal(name: object, value: object) -> str | None:
    """Why a tenant-given request header is refused (None: it may be sent)."""
    if not isinstance(name, str) or not isinstance(value, str):
        return "header names and values must be strings"
    if not _TOKEN.match(name):
        return "not a valid header name"
    if name.lower() in FORBIDDEN_HEADERS:
        return "this header is set by the service, not by a grader"
    if any(c in value for c in "\r\n\x00"):
        return "header values may not contain line breaks or NUL"
    return None
