"""The ``openenv`` environment spec: a tenant-hosted OpenEnv server, its episodes' seeds, turns and reward."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: The rows' reset seeds of the held-out split start here past the training seeds (disjoint for any size).
HELD_OUT_SEED_OFFSET = 1_000_000_007
#: Headers a spec may give (each checked by the egress policy's header rules).
MAX_HEADERS = 32


class OpenEnvEnvironment(BaseModel):
    """An OpenEnv server (PyPI ``openenv``) the tenant hosts, reached through the egress policy. Every prompt is
    one reset seed: its ``group_size`` episodes each open their own session and reset with that seed, the reset
    observation is the first user message, every model turn is sent as the action and the next observation is
    the next user message, until the server says ``done`` or ``max_turns`` turns were sampled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["openenv"]
    url: str = Field(
        ...,
        min_length=1,
        max_length=2000,
        description="The server's base URL (http or https); its WebSocket session is at <url>/ws (ws/wss).",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_HEADERS,
        description="Headers sent with every request and the WebSocket handshake (redacted in the API's output).",
    )
    transport: Literal["websocket", "http"] = Field(
        "websocket",
        description="websocket: one session per episode at /ws (the default); http: POST /reset and /step, for a "
        "server that keeps one episode's state between HTTP calls (the only way such a server offers).",
    )
    max_turns: int = Field(8, ge=1, le=64, description="Model turns of an episode (steps sent to the server).")
    episode_reward: Literal["sum", "last"] = Field(
        "sum", description="The episode's reward: the sum of its steps' rewards, or the last step's."
    )
    action_field: str = Field(
        "message",
        min_length=1,
        max_length=100,
        description="The action's field that holds the model's turn as text: a step sends {action_field: text}.",
    )
    observation_field: str | None = Field(
        None,
        max_length=100,
        description="The observation's field shown to the model as the user message (its text); null: the whole "
        "observation as JSON, without reward, done and metadata.",
    )
    system_prompt: str | None = Field(None, max_length=8000, description="A system message before the first one.")
    seed: int = Field(0, ge=0, le=2**31 - 1, strict=True, description="Row i resets with seed + i.")
    size: int = Field(1000, ge=1, le=100_000, strict=True, description="Training rows (distinct reset seeds).")
    validation_size: int = Field(
        0, ge=0, le=10_000, strict=True, description="Held-out rows (reset seeds past the training ones); 0 = none."
    )
    timeout_s: float = Field(30.0, ge=0.1, le=600.0, description="Seconds one reset or step may take.")
