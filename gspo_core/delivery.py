"""One POST of a prepared body to a tenant's URL through the egress policy, its answer classified for retry."""

from __future__ import annotations

import httpx

from gspo_core.egress import EgressPolicy, EgressRefused
from gspo_core.egress_client import PinnedTransport


def make_client(policy: EgressPolicy, timeout: float, max_connections: int) -> httpx.Client:
    """An HTTP client whose connections go only where the egress policy allows (pinned addresses),
    redirects not followed: a signed body goes to the registered URL only."""
    return httpx.Client(
        transport=PinnedTransport(policy, max_connections=max_connections),
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
    )


def post(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, str | None, bool]:
    """One attempt: ``(status code, error text or None on a 2xx, whether to retry)``. The answer's body is
    never read, so none of it can reach the tenant; errors say what failed, not what the remote said."""
    try:
        with client.stream("POST", url, content=body, headers=headers) as resp:
            code = resp.status_code
    except EgressRefused as exc:
        return None, f"refused by the egress policy: {exc}", False
    except httpx.InvalidURL:
        return None, "not a valid URL", False
    except httpx.TimeoutException:
        timeout = client.timeout.read
        return None, f"no answer within {timeout:g} s" if timeout else "no answer in time", True
    except httpx.HTTPError:  # refused, reset, TLS failure, not HTTP: one text for all (no port scanning)
        return None, "could not get an answer (connection or protocol error)", True
    if 200 <= code < 300:
        return code, None, False
    if 300 <= code < 400:
        return code, f"HTTP {code}: redirects are not followed", False
    return code, f"HTTP {code}", code >= 500 or code in (408, 429)
