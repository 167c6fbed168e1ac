"""What the Tinker route tests share: a tenant's key as the SDK sends it, and opening a session over HTTP."""

from __future__ import annotations


def tml(auth: dict) -> dict:
    """The tenant's bearer key as the SDK's ``X-API-Key: tml-<key>`` header."""
    return {"X-API-Key": "tml-" + auth["Authorization"].removeprefix("Bearer ")}


def open_session(client, headers) -> str:
    r = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["session_id"]
