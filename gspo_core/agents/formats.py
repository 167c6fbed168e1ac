"""Tool-call formats by model family, registered by name: how calls are parsed from a turn's sampled text."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gspo_core.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's ``name`` and its ``arguments`` (a JSON object), or ``error``
    (the call could not be parsed; the model is told so, as a tool result)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def openai(self, call_id: str) -> dict:
        """OpenAI's shape of a tool call (``sample.output_tools`` entries, transcript messages)."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


#: A format parses one turn's sampled text into its tool calls (none: the turn is the final answer).
Parser = Callable[[str], list[ToolCall]]
FORMATS: Registry[Parser] = Registry("tool-call format")

HERMES_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@FORMATS.register("hermes")
def parse_hermes(text: str) -> list[ToolCall]:
    """Hermes/Qwen2.5/Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
    call (the rule of vLLM's ``hermes`` tool parser and of these models' chat templates)."""
    calls = []
    for match in HERMES_RE.finditer(text):
        body = match.group(1).strip()
        try:
            obj = json.loads(body)
        except ValueError:
            calls.append(ToolCall(name="", error=f"not JSON: {body[:200]}"))
            continue
        calls.append(_call_of(obj))
    return calls


def _call_of(obj: object) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(name="", error='a call is {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments JSON-encoded
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error="arguments must be a JSON object")
    return ToolCall(name=obj["name"], arguments=args)


TOY_RE = re.compile(r"\{(\w+)(?::([^{}]*))?\}")


@FORMATS.register("toy")
def parse_toy(text: str) -> list[ToolCall]:
    """The toy tokenizer's format, short enough for a tiny character-level model to learn: ``{name}`` or
    ``{name:value}``; ``value`` goes to the tool's first parameter (``arguments["_"]`` until the toolbox
    maps it, see `gspo_core.agents.tools.Toolbox.call`)."""
    return [
        ToolCall(name=m.group(1), arguments={} if m.group(2) is None else {"_": m.group(2)})
        for m in TOY_RE.finditer(text)
    ]


def pick_format(name: str, tokenizer: PreTrainedTokenizerBase) -> Parser:
    """The parser named ``name``; ``auto``: hermes where the chat template speaks of ``<tool_call>``, else toy."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None) or ""
        name = "hermes" if "<tool_call>" in str(template) else "toy"
    return FORMATS.get(name)
