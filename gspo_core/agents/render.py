"""The environment's tokens after a turn: tool results rendered through the chat template's tool role."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

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


def tool_turn_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], stop_text: str) -> list[int]:
    """:func:`tool_turn_text` as token ids, tokenized on its own (appended after the exact sampled ids)."""
    text = tool_turn_text(tokenizer, messages, stop_text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
