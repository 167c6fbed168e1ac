"""Dataset validation names the line and field; prompts render through the chat template."""

from __future__ import annotations

import json

import pytest

from gspo_core.data import DataError, item_of, load_rows, render_prompt, validate_jsonl_bytes


def test_valid_rows_and_blank_lines():
    data = b'{"prompt": "a", "x": 1}\n\n   \n{"messages": [{"role": "user", "content": "b"}]}\n\n'
    rows = validate_jsonl_bytes(data)
    assert rows == [{"prompt": "a", "x": 1}, {"messages": [{"role": "user", "content": "b"}]}]


def test_crlf_no_trailing_newline_and_unicode():
    rows = validate_jsonl_bytes('{"prompt": "é"}\r\n{"prompt": "日本"}'.encode())
    assert [r["prompt"] for r in rows] == ["é", "日本"]


@pytest.mark.parametrize(
    "data,line,field",
    [
        pytest.param(b'{"prompt": "a"}\n\xff\n', 2, None, id="non-utf8"),
        pytest.param(b'{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "\xc3"}\n', 4, None, id="non-utf8-after-blank"),
        pytest.param(b'{"prompt": "a"}\n{bad\n', 2, None, id="non-json"),
        pytest.param(b"[1]\n", 1, None, id="array"),
        pytest.param(b'{"prompt": "a"}\n"text"\n', 2, None, id="string"),
        pytest.param(b'{"prompt": "a"}\nnull\n', 2, None, id="null"),
        pytest.param(b'{"q": 1}\n', 1, "prompt", id="neither"),
        pytest.param(b'{"prompt": "a"}\n\n{"prompt": ""}\n', 3, "prompt", id="empty-prompt"),
        pytest.param(b'{"prompt": 3}\n', 1, "prompt", id="prompt-not-str"),
        pytest.param(b'{"messages": []}\n', 1, "messages", id="empty-messages"),
        pytest.param(b'{"messages": "hi"}\n', 1, "messages", id="messages-not-list"),
        pytest.param(b'{"messages": [{"role": "user", "content": 1}]}\n', 1, "messages[0]", id="content-not-str"),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}\n',
            1,
            "messages[1]",
            id="message-no-role",
        ),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "a"}, "b"]}\n', 1, "messages[1]", id="message-not-obj"
        ),
        pytest.param(b"", None, None, id="empty-file"),
        pytest.param(b"\n  \n\n", None, None, id="blank-file"),
    ],
)
def test_bad_rows(data, line, field):
    with pytest.raises(DataError) as exc:
        validate_jsonl_bytes(data)
    assert exc.value.line == line and exc.value.field == field
    assert isinstance(exc.value, ValueError)
    if line is not None:
        assert str(exc.value).startswith(f"line {line}: ")


def test_error_messages():
    with pytest.raises(DataError, match="not valid UTF-8"):
        validate_jsonl_bytes(b"\xff")
    with pytest.raises(DataError, match="not valid JSON"):
        validate_jsonl_bytes(b"{bad")
    with pytest.raises(DataError, match="expected a JSON object, got list"):
        validate_jsonl_bytes(b"[1]")
    with pytest.raises(DataError, match="file is empty"):
        validate_jsonl_bytes(b"")


def test_row_cap():
    assert len(validate_jsonl_bytes(b'{"prompt": "a"}\n' * 2, max_rows=2)) == 2
    with pytest.raises(DataError, match="too many rows: the limit is 2") as exc:
        validate_jsonl_bytes(b'{"prompt": "a"}\n\n' * 3, max_rows=2)
    assert exc.value.line == 5 and exc.value.field is None


def test_load_rows(tmp_path):
    with pytest.raises(DataError, match="not found") as exc:
        load_rows(str(tmp_path / "nope.jsonl"))
    assert exc.value.line is None
    with pytest.raises(DataError, match="not found"):
        load_rows(str(tmp_path))  # a directory is not a dataset file
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(3)) + "\n")
    rows = load_rows(str(p))
    assert [r["prompt"] for r in rows] == ["p0", "p1", "p2"]
    assert item_of(rows[1]) == {"prompt": "p1", "answer": 1}
    with pytest.raises(DataError, match="too many rows"):
        load_rows(str(p), max_rows=2)
    with pytest.raises(DataError, match="hf:NAME"):
        load_rows("hf:only_name")


def test_render_prompt(tmp_path):
    from gspo_core.toy import build_tokenizer

    tok = build_tokenizer(tmp_path)
    assert render_prompt({"prompt": "hi"}, tok) == "hi"
    # a row with a prompt passes it through even when it also has messages
    assert render_prompt({"prompt": "raw", "messages": [{"role": "user", "content": "x"}]}, tok) == "raw"
    text = render_prompt({"messages": [{"role": "user", "content": "hi"}]}, tok)
    assert text == "<|user|>hi\n<|assistant|>"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert render_prompt({"messages": msgs}, tok) == "<|system|>be brief\n<|user|>2+2?\n<|assistant|>"


def test_crlf_bom_and_unicode_line_separators_inside_strings():
    data = '\ufeff{"prompt": "a\u2028b\u0085c"}\r\n{"prompt": "d"}\r\n'.encode()
    rows = validate_jsonl_bytes(data)
    assert [r["prompt"] for r in rows] == ["a\u2028b\u0085c", "d"]


def test_row_cap_is_inclusive_and_reports_the_first_extra_line():
    assert len(validate_jsonl_bytes(b'{"prompt": "a"}\n' * 2, max_rows=2)) == 2
    with pytest.raises(DataError) as exc:
        validate_jsonl_bytes(b'{"prompt": "a"}\n\n{"prompt": "a"}\n{"prompt": "a"}\n', max_rows=2)
    assert exc.value.line == 4


def test_invalid_utf8_after_bom_names_its_line():
    with pytest.raises(DataError) as exc:
        validate_jsonl_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "\xff"}\n')
    assert exc.value.line == 2 and "UTF-8" in str(exc.value)


def test_load_rows_reads_a_jsonl_file_and_keeps_item_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "answer": "4", "meta": {"k": [1]}}\n')
    assert load_rows(str(path)) == [{"prompt": "p", "answer": "4", "meta": {"k": [1]}}]
    with pytest.raises(DataError, match="hf:NAME"):
        load_rows("hf:only")


def test_nesting_is_decided_on_bytes_before_any_parse():
    from gspo_core.data import MAX_DEPTH, nesting_exceeds

    assert not nesting_exceeds(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    assert nesting_exceeds(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))
    assert nesting_exceeds(b'{"a": ' + b'[{"b": ' * 17 + b"1" + b"}]" * 17 + b"}")
    assert nesting_exceeds((b"[" * 32 + b"]") * 3)  # deep without a long run of openers
    assert not nesting_exceeds(b'{"s": "' + b"[" * 100 + b'\\" [[["}')  # brackets in strings do not count
    assert not nesting_exceeds(b"[" + b"[]," * 10_000 + b"[]]")  # wide is not deep
    assert not nesting_exceeds(b'{"a": [}')  # unbalanced: the parser's to refuse


def test_loads_strict_names_the_path():
    from gspo_core.data import JsonValueError, loads_strict

    assert loads_strict('{"a": [1, 2.5, -3, "x", {"b": null}], "e": "\\ud83d\\ude00"}') == {
        "a": [1, 2.5, -3, "x", {"b": None}],
        "e": "\U0001f600",
    }
    cases = {
        '{"a": [1, NaN]}': "a[1]",
        '{"a": {"b": -Infinity}}': "a.b",
        '{"x": 1e999}': "x",
        '{"n": ' + "1" * 1001 + "}": "n",
        '{"s": ["ok", "\\udfff"]}': "s[1]",
        '{"d": ' + "[" * 40 + "]" * 40 + "}": "d" + "[0]" * 31,
        "[" * 100_000 + "]" * 100_000: "",
    }
    for text, path in cases.items():
        with pytest.raises(JsonValueError) as exc:
            loads_strict(text)
        assert exc.value.path == path, text[:40]
    with pytest.raises(json.JSONDecodeError):
        loads_strict("{bad")


def test_long_lines_are_refused_before_they_are_read_whole():
    import io

    from gspo_core.data import iter_jsonl

    data = b'{"prompt": "a"}\n{"prompt": "' + b"b" * 100 + b'"}\n'
    assert len(list(iter_jsonl(io.BytesIO(data), max_row_bytes=200))) == 2
    with pytest.raises(DataError, match="longer than 50 bytes") as exc:
        list(iter_jsonl(io.BytesIO(data), max_row_bytes=50))
    assert exc.value.line == 2
    with pytest.raises(DataError, match="at most 256") as exc:
        validate_jsonl_bytes(json.dumps({"prompt": "a", **{f"k{i}": i for i in range(300)}}).encode())
