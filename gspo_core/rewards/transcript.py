"""A grader's ``sample`` from a chat transcript: the one rule the trainer's episodes and the API's dry runs share."""

from __future__ import annotations

from typing import Any

from gspo_core.rewards.base import sample_for

ROLES = ("system", "developer", "user", "assistant", "tool")
#: Most messages a dry run's transcript may have.
MAX_MESSAGES = 256


class TranscriptError(ValueError):
    """A transcript that is not OpenAI's chat shape; ``field`` names where (``messages[2].tool_calls[0]``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def transcript_sample(messages: list[dict], tokens: int | None = None, finish_reason: str = "stop") -> dict:
    """What graders see as ``sample`` for an episode's transcript: ``output_text`` is the last assistant
    message's text, ``output_tools`` every assistant ``tool_calls`` entry in order, ``messages`` the
    transcript itself; ``tokens`` (None: the assistant texts' characters, as dry runs count)."""
    said = [m for m in messages if m.get("role") == "assistant"]
    text = (said[-1].get("content") or "") if said else ""
    calls = [call for m in said for call in m.get("tool_calls") or ()]
    if tokens is None:
        tokens = sum(len(m.get("content") or "") for m in said)
    return sample_for(text, tokens, finish_reason, calls, messages)


def check_transcript(messages: Any) -> None:
    """OpenAI's chat shape: roles, string (or, for assistant turns, null) contents, assistant ``tool_calls``
    as ``{"id", "type": "function", "function": {"name", "arguments" (a JSON string)}}``, at least one
    assistant message. :class:`TranscriptError` names the first bad field."""
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise TranscriptError("messages", f"must be a list of 1 to {MAX_MESSAGES} chat messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise TranscriptError(f"{where}.role", f"each message is an object whose role is one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
            raise TranscriptError(f"{where}.content", "must be a string (null only for an assistant turn)")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
            raise TranscriptError(f"{where}.tool_calls", "only assistant messages have tool_calls, a list")
        for j, call in enumerate(calls or ()):
            _check_call(call, f"{where}.tool_calls[{j}]")
    if not any(m["role"] == "assistant" for m in messages):
        raise TranscriptError("messages", "has no assistant message (the answer graders read)")


def _check_call(call: Any, where: str) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
        raise TranscriptError(where, 'a tool call is {"id", "type": "function", "function": {"name", "arguments"}}')
    if not isinstance(call.get("id", ""), str):
        raise TranscriptError(f"{where}.id", "must be a string")
    if not isinstance(function.get("name"), str):
        raise TranscriptError(f"{where}.function.name", "must be a string")
    if not isinstance(function.get("arguments", ""), str):
        raise TranscriptError(f"{where}.function.arguments", "must be a JSON string, as OpenAI's tool calls have it")
