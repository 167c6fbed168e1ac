"""The JSON schema of a job's ``tools`` entries (python, http, mcp, agent), as OpenAPI shows them: each field with
its bounds (`gspo_core.agents.tools` enforces them, naming the field) and an example."""

from __future__ import annotations

from typing import Any

from gspo_core.rewards.policy import DEFAULT_POLICY

#: Seconds an http tool call or an MCP request may take, and an agent's reply (`gspo_core.agents.tools`, `.mcp`).
HTTP_TIMEOUT_S = (0.01, 600.0)
AGENT_TIMEOUT_S = (1.0, 3600.0)
_URL = {"type": "string", "maxLength": 2048, "description": "http(s) URL; refused addresses as for graders"}
_HEADERS = {"type": "object", "additionalProperties": {"type": "string"}, "description": "Sent with each request"}


def _timeout(bounds: tuple[float, float], default: float, what: str) -> dict[str, Any]:
    return {"type": "number", "minimum": bounds[0], "maximum": bounds[1], "default": default, "description": what}


def _variant(kind: str, props: dict[str, Any], required: list[str], example: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "title": f"{kind} tool",
        "properties": {"type": {"const": kind}, **props},
        "required": ["type", *required],
        "additionalProperties": False,
        "examples": [{"type": kind, **example}],
    }


def _python() -> dict[str, Any]:
    return _variant(
        "python",
        {
            "source": {"type": "string", "description": "Python source defining typed public functions"},
            "timeout_s": _timeout(
                (0.01, DEFAULT_POLICY.max_timeout_s),
                5.0,
                "Seconds a call may run in the sandbox (at most the operator's grader timeout)",
            ),
        },
        ["source"],
        {"source": "def add(a: int, b: int):\n    return a + b\n"},
    )


def _http() -> dict[str, Any]:
    return _variant(
        "http",
        {
            "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_-]{0,63}$"},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": 'A JSON schema of {"type": "object"}'},
            "server_url": _URL,
            "headers": _HEADERS,
            "timeout_s": _timeout(HTTP_TIMEOUT_S, 10.0, "Seconds a call may take"),
        },
        ["name", "server_url"],
        {"name": "lookup", "server_url": "https://tools.example.com/lookup"},
    )


def openai_tool_schema() -> dict[str, Any]:
    """One of Agent RFT's tools: an http tool without its ``type``."""
    schema = _http()
    props = {k: v for k, v in schema["properties"].items() if k != "type"}
    example = {k: v for k, v in schema["examples"][0].items() if k != "type"}
    return {
        **schema,
        "title": "Agent RFT tool",
        "properties": props,
        "required": ["name", "server_url"],
        "examples": [example],
    }


def tool_entry_schema() -> dict[str, Any]:
    """One entry of ``tools``: any of the four kinds (an agent comes alone)."""
    http = {"server_url": _URL, "headers": _HEADERS}
    return {
        "anyOf": [
            _python(),
            _http(),
            _variant(
                "mcp",
                {
                    **http,
                    "allowed_tools": {"type": "array", "items": {"type": "string"}},
                    "timeout_s": _timeout(HTTP_TIMEOUT_S, 10.0, "Seconds a request to the server may take"),
                },
                ["server_url"],
                {"server_url": "https://mcp.example.com/mcp"},
            ),
            _variant(
                "agent",
                {**http, "timeout_s": _timeout(AGENT_TIMEOUT_S, 300.0, "Seconds the agent may take to reply")},
                ["server_url"],
                {"server_url": "https://agent.example.com/episode"},
            ),
        ]
    }
