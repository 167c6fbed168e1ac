"""Dataset validation names the line and field; prompts render through the chat template."""

from __future__ import annotations

import pytest

from gspo_core.data import DataError, load_rows, render_prompt, validate_jsonl_bytes


def test_valid_rows_and_blank_lines():
    rows = validate_jsonl_bytes(b'{"prompt": "a", "x": 1}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert len(rows) == 2 and rows[0]["x"] == 1


@pytest.mark.parametrize("data,line,field", [
    (b'{"prompt": "a"}\n\xff\n', 2, None), (b'{"prompt": "a"}\n{bad\n', 2, None), (b"[1]\n", 1, None),
    (b'{"q": 1}\n', 1, "prompt"), (b'{"prompt": 3}\n', 1, "prompt"), (b'{"messages": []}\n', 1, "messages"),
    (b'{"messages": [{"role": "user", "content": 1}]}\n', 1, "messages[0]"), (b"", None, None),
])
def test_bad_rows(data, line, field):
    with pytest.raises(DataError) as exc:
        validate_jsonl_bytes(data)
    assert exc.value.line == line and exc.value.field == field


def test_row_cap_and_missing_file(tmp_path):
    with pytest.raises(DataError, match="too many rows"):
        validate_jsonl_bytes(b'{"prompt": "a"}\n' * 3, max_rows=2)
    with pytest.raises(DataError, match="not found"):
        load_rows(str(tmp_path / "nope.jsonl"))


def test_render_prompt(tmp_path):
    from gspo_core.toy import build_tokenizer

    tok = build_tokenizer(tmp_path)
    assert render_prompt({"prompt": "hi"}, tok) == "hi"
    text = render_prompt({"messages": [{"role": "user", "content": "hi"}]}, tok)
    assert text == "<|user|>hi\n<|assistant|>"
