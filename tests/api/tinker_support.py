"""What the Tinker tests share: a tenant's key as the SDK sends it, opening a session over HTTP, the SDK tests'
cross-entropy datum and its mean loss."""

from __future__ import annotations


def tml(auth: dict) -> dict:
    """The tenant's bearer key as the SDK's ``X-API-Key: tml-<key>`` header."""
    return {"X-API-Key": "tml-" + auth["Authorization"].removeprefix("Bearer ")}


def open_session(client, headers) -> str:
    r = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def datum(tokens: list[int]):
    """Next-token cross-entropy on every position but the first (an SDK ``types.Datum``)."""
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] + [1.0] * (len(tokens) - 2)},
    )


def mean_loss(out, data: list) -> float:
    """The weighted mean cross-entropy of ``data`` from a ``forward_backward`` output's per-token log-probs."""
    logps = [lp for o in out.loss_fn_outputs for lp in o["logprobs"].tolist()]
    weights = [w for d in data for w in d.loss_fn_inputs["weights"].tolist()]
    return -sum(lp * w for lp, w in zip(logps, weights, strict=True)) / sum(weights)
