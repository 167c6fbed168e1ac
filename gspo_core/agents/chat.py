"""The OpenAI chat-completions shapes the bring-your-own-agent endpoint speaks (`gspo_core.agents.remote`):
requests read, messages compared, tool calls and errors written, an agent's reported reward read."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

#: A reward an agent reports is clipped to this range (a runaway value would swamp the group's advantages).
REWARD_RANGE = (-10.0, 10.0)
ROLES = {"system", "developer", "user", "assistant", "tool"}


class RequestError(ValueError):
    """A chat request the endpoint refuses: answered as OpenAI's 400 ``invalid_request_error``."""


@dataclass(frozen=True)
class ChatRequest:
    """What the endpoint uses of a chat request: ``messages`` (content as text), ``tools`` (OpenAI's function
    tools, None: none offered), ``cap`` (``max_completion_tokens`` / ``max_tokens``, 0: none)."""

    messages: list[dict]
    tools: list[dict] | None
    cap: int


def _text(content: Any, where: str) -> str:
    """A message's content as text (OpenAI's list of text parts: their ``text`` joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of text parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f'{where}[{j}]: only text parts are supported ({{"type": "text", "text": "..."}})')
    return "".join(part["text"] for part in content)


def _strings(obj: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise RequestError(f"{where}.{key}: must be a string")


def _tool_calls(calls: Any, where: str) -> None:
    """An assistant message's ``tool_calls`` in OpenAI's shape (``function.arguments`` a JSON string)."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}: must be a list of tool calls")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RequestError(f'{at}.function: must be an object {{"name": ..., "arguments": "<JSON>"}}')
        _strings(call, ("id", "type"), at)
        fn = call["function"]
        if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
            raise RequestError(f"{at}.function: its name and arguments (a JSON text) must be strings")


def _message(m: Any, where: str) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(sorted(ROLES))}")
    _strings(m, ("name", "tool_call_id"), where)
    if m.get("tool_calls") is not None:
        _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return {**{k: v for k, v in m.items() if v is not None}, "content": _text(m.get("content"), f"{where}.content")}


def _tools(tools: Any) -> list[dict] | None:
    """OpenAI's function tools: ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools: must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(f'tools[{i}]: must be {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name: must be a non-empty string")
        _strings(fn, ("description",), f"tools[{i}].function")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and isinstance(params.get("properties", {}), dict)):
            raise RequestError(f"tools[{i}].function.parameters: must be a JSON schema object")
    return tools


def parse_request(body: bytes) -> ChatRequest:
    """A chat request checked field by field; a :class:`RequestError` names the first field that is wrong."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise RequestError("the body is not JSON") from None
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list) or not req["messages"]:
        raise RequestError("messages: a non-empty list of chat messages is required")
    if req.get("stream"):
        raise RequestError("stream: streaming is not supported")
    if req.get("n", 1) != 1:
        raise RequestError("n: only 1 completion per request")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(req["messages"])]
    cap = req.get("max_completion_tokens") or req.get("max_tokens") or 0
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise RequestError("max_tokens must be a positive integer")
    return ChatRequest(messages, _tools(req.get("tools")), cap)


def same_message(ours: dict, theirs: dict) -> bool:
    """Whether the agent sent back a message as the service produced it (role, text, calls' names and args)."""

    def calls(m: dict) -> list:
        out = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {} if isinstance(c, dict) else {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError, RecursionError):  # not JSON (or nested past the parser): as text
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
