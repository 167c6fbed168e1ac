"""The environment's tokens after a turn: tool results rendered through the chat template's tool role, their
text (a tool's, an agent's) tokenized as plain text even where it spells a special token."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Stands for a sampled assistant turn while the template renders the tool messages after it.
MARK = "\u2063GSPO-TURN\u2063"
#: For a tokenizer without a chat template (or one whose template has no usable tool role): each result on
#: its own, then the model's turn goes on.
FIXED = "\n<tool_result>\n{content}\n</tool_result>\n"


def tool_turn_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict], stop_text: str) -> str:
    """The text the chat template puts after an assistant turn that ended with the sampled ``stop_text``
    (its EOS, or "" when cut by the budget): the end of that turn not sampled, then ``messages`` (the
    ``tool`` role), then the next assistant turn's header.

    Only this suffix is rendered: the sampled turns are never rendered again, so a template that rewrites
    the history (Qwen3 dropping earlier ``<think>`` blocks) cannot change a token the model sampled."""
    fixed = "".join(FIXED.format(content=m["content"]) for m in messages)
    if not getattr(tokenizer, "chat_template", None):
        return fixed
    head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
    try:
        base = cast(str, tokenizer.apply_chat_template(head, tokenize=False))
        full = cast(str, tokenizer.apply_chat_template(head + messages, tokenize=False, add_generation_prompt=True))
    except Exception:  # a template that refuses tool messages (no tool role): the fixed format
        return fixed
    cut = base.rfind(MARK) + len(MARK)
    if cut < len(MARK) or full[:cut] != base[:cut]:  # no tool role that follows a turn as it was: fixed format
        return fixed
    tail = full[cut:]
    return tail[len(stop_text) :] if stop_text and tail.startswith(stop_text) else tail


class PlainText:
    """Renders text that is not the service's own (tool results, an agent's messages and tools) so that a
    special token's string in it (``<|im_end|>``, ``</s>``) stays text: before the render each such string is
    stood in for by a marker of this call's own (plain letters, which neither templates nor JSON escape);
    after it, the text between markers is tokenized as usual (the template's own special tokens stay
    special) and each marked string with ``split_special_tokens`` (the tokenizer's public switch)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in decoder.values() if t.special} | set(tokenizer.all_special_tokens)
        ordered = sorted((t for t in specials if t), key=len, reverse=True)  # longest first: "<s>" inside "</s>"
        self.specials = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.nonce = f"gspo{secrets.token_hex(8)}"
        self.marker = re.compile(f"{self.nonce}q(\\d+)q")
        self.hidden: list[str] = []

    def hide(self, obj: Any) -> Any:
        """``obj`` (strings, lists, tuples, dicts of them) with each special token's string marked."""
        if isinstance(obj, str):
            return self.specials.sub(self._mark, obj) if self.specials else obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.hide(v) for v in obj)
        if isinstance(obj, dict):
            return {k: self.hide(v) for k, v in obj.items()}
        return obj

    def _mark(self, match: re.Match[str]) -> str:
        self.hidden.append(match.group())
        return f"{self.nonce}q{len(self.hidden) - 1}q"

    def ids(self, text: str) -> list[int]:
        """``text`` rendered from hidden values, as token ids: the marked strings as plain text."""
        if not self.hidden:
            return self._encode(text)
        pieces = self.marker.split(text)  # text, index, text, index, ..., text
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self._encode(self.hidden[int(piece)], split=True)
            elif piece:
                ids += self._encode(piece)
        return ids

    def _encode(self, text: str, split: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=split)["input_ids"])

    def render(self, render: Callable[[Any], str], untrusted: Any) -> list[int]:
        """The ids of ``render(untrusted)``, ``untrusted``'s special-token strings kept as plain text."""
        return self.ids(render(self.hide(untrusted)))


def tool_turn_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], stop_text: str) -> list[int]:
    """:func:`tool_turn_text` as token ids, tokenized on its own (appended after the exact sampled ids); the
    messages' text is plain text (:class:`PlainText`)."""
    return PlainText(tokenizer).render(lambda hidden: tool_turn_text(tokenizer, hidden, stop_text), messages)
