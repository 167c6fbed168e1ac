"""The OpenAI chat-completions shapes the bring-your-own-agent endpoint speaks (`gspo_core.agents.remote`):
requests read, messages compared, tool calls and errors written, an agent's reported reward read."""

from __future__ import annotations

import json
import math
from typing import Any

#: A reward an agent reports is clipped to this range (a runaway value would swamp the group's advantages).
REWARD_RANGE = (-10.0, 10.0)
ROLES = {"system", "developer", "user", "assistant", "tool"}


class RequestError(ValueError):
    """A chat request the endpoint refuses: answered as OpenAI's 400 ``invalid_request_error``."""


def _text(content: Any) -> str:
    """A message's content as text (OpenAI's list of parts: their ``text`` joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RequestError("messages[].content must be a string or a list of text parts")


def parse_request(body: bytes) -> dict:
    """The fields of a chat request the endpoint uses: ``messages`` (content as text), ``tools``, ``cap``."""
    try:
        req = json.loads(body)
    except ValueError:
        raise RequestError("the body is not JSON") from None
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list) or not req["messages"]:
        raise RequestError("messages: a non-empty list of chat messages is required")
    if req.get("stream"):
        raise RequestError("stream: streaming is not supported")
    if req.get("n", 1) != 1:
        raise RequestError("n: only 1 completion per request")
    messages = []
    for i, m in enumerate(req["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}")
        msg = {**{k: v for k, v in m.items() if v is not None}, "content": _text(m.get("content"))}
        messages.append(msg)
    tools = req.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list")
    cap = req.get("max_completion_tokens") or req.get("max_tokens") or 0
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise RequestError("max_tokens must be a positive integer")
    return {"messages": messages, "tools": tools, "cap": cap}


def same_message(ours: dict, theirs: dict) -> bool:
    """Whether the agent sent back a message as the service produced it (role, text, calls' names and args)."""

    def calls(m: dict) -> list:
        out = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {} if isinstance(c, dict) else {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                args = fn.get("arguments")
            out.append((fn.get("name"), args))
        return out

    keys = ("role", "content", "tool_call_id")
    return all(ours.get(k) == theirs.get(k) for k in keys) and calls(ours) == calls(theirs)


def error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}


def reward_of(body: bytes) -> tuple[float | None, str | None]:
    """``(reward, error)`` of an agent's reply: its ``reward`` clipped to :data:`REWARD_RANGE`; none given
    (or a body that is not a JSON object): the grader's."""
    try:
        reply = json.loads(body) if body.strip() else None
    except ValueError:
        return None, None
    if not isinstance(reply, dict) or reply.get("reward") is None:
        return None, None
    value = reply["reward"]
    # Clipped before float(): math.isfinite() or float() of a 400-digit integer raises.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == math.inf:
        return None, "bad_reward"
    return float(min(max(value, REWARD_RANGE[0]), REWARD_RANGE[1])), None


def with_names(call: dict, tools: list | None) -> dict:
    """A toy-format call's one positional value (``{"_": v}``) under the name of the tool's first parameter."""
    args = json.loads(call["function"]["arguments"])
    if set(args) != {"_"}:
        return call
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        props = list(((fn or {}).get("parameters") or {}).get("properties") or {})
        if fn and fn.get("name") == call["function"]["name"] and props:
            return {**call, "function": {**call["function"], "arguments": json.dumps({props[0]: args["_"]})}}
    return call
