"""Supervised rows: checks naming line and field, and loss masks exactly on the assistant turns."""

from __future__ import annotations

import io
import json

import pytest

from gspo_core.data import DataError, check_sft_file
from gspo_core.sft import chat_pieces, encode_chat


def test_mask_covers_exactly_the_weighted_assistant_turns(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say a:"},
        {"role": "assistant", "content": "aaaa"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "zz", "weight": 0},
        {"role": "user", "content": "b?"},
        {"role": "assistant", "content": "bb"},
    ]
    pieces = chat_pieces(messages, tok)
    assert "".join(text for text, _ in pieces) == tok.apply_chat_template(messages, tokenize=False)
    assert [text for text, weight in pieces if weight] == ["aaaa\n", "bb\n"]  # the turn's end is generated too
    ids, weights = encode_chat(messages, tok, 1000)
    assert tok.decode([i for i, w in zip(ids, weights, strict=True) if w]) == "aaaa\nbb\n"
    assert encode_chat(messages, tok, 10) == (ids[:10], weights[:10])


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": "x"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "weight": 1}]}, "messages[0].weight"),
        ({"messages": [{"role": "assistant", "content": "x", "weight": 0.5}]}, "messages[0].weight"),
        ({"messages": [{"role": "assistant", "content": "x", "weight": True}]}, "messages[0].weight"),
        ({"messages": [{"role": "assistant", "content": "x", "weight": 0}]}, "messages"),
    ],
)
def test_bad_supervised_rows_name_line_and_field(row, field):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    data = (json.dumps(good) + "\n\n" + json.dumps(row) + "\n").encode()
    with pytest.raises(DataError) as exc:
        check_sft_file(io.BytesIO(data))
    assert (exc.value.line, exc.value.field) == (3, field)
    assert check_sft_file(io.BytesIO((json.dumps(good) + "\n").encode())) == 1
