"""Prompt datasets: JSONL validation with line numbers, loading, and prompt rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A bad dataset row: ``line`` is 1-based (None for whole-file problems), ``field`` names the key."""

    def __init__(self, line: int | None, field: str | None, message: str) -> None:
        self.line, self.field, self.message = line, field, message
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{message}")


def _check_row(row: Any, line: int) -> dict:
    if not isinstance(row, dict):
        raise DataError(line, None, f"expected a JSON object, got {type(row).__name__}")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DataError(line, "prompt", "`prompt` must be a non-empty string")
        return row
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(line, "messages", "`messages` must be a non-empty list")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(line, f"messages[{i}]", "each message needs string `role` and `content`")
        return row
    raise DataError(line, "prompt", "row has neither `prompt` (text) nor `messages` (chat)")


def validate_jsonl_bytes(data: bytes, *, max_rows: int = 1_000_000) -> list[dict]:
    """Parse and validate a JSONL upload; raise :class:`DataError` naming the line and field."""
    try:
        text = data.decode("utf-8-sig")  # tolerate the BOM some editors write
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(line, None, f"file is not valid UTF-8 (byte {exc.start})") from None
    rows: list[dict] = []
    # Split on "\n" only: str.splitlines() would also break inside JSON strings holding U+2028 etc.
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DataError(lineno, None, f"not valid JSON: {exc.msg} (column {exc.colno})") from None
        if len(rows) == max_rows:
            raise DataError(lineno, None, f"too many rows: the limit is {max_rows}")
        rows.append(_check_row(obj, lineno))
    if not rows:
        raise DataError(None, None, "file is empty: it needs at least one JSON object line")
    return rows


def load_rows(source: str, *, max_rows: int = 10_000_000) -> list[dict]:
    """Rows from a JSONL path, or ``hf:name[:config]:split`` through `datasets` when installed."""
    if source.startswith("hf:"):
        return _load_hf(source[3:])
    path = Path(source)
    if not path.is_file():
        raise DataError(None, None, f"dataset file not found: {source}")
    return validate_jsonl_bytes(path.read_bytes(), max_rows=max_rows)


def _load_hf(spec: str) -> list[dict]:
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise DataError(None, None, "use hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    try:
        import datasets  # optional: only users with hub access need it
    except ImportError:
        raise DataError(None, None, "install `datasets` to load Hugging Face datasets by name") from None
    name, split = parts[0], parts[-1]
    config = parts[1] if len(parts) == 3 else None
    ds = datasets.load_dataset(name, config, split=split)
    return [_check_row(dict(r), i + 1) for i, r in enumerate(ds)]


def render_prompt(row: dict, tokenizer) -> str:
    """The prompt text of a row: ``prompt`` as is, or ``messages`` through the chat template."""
    if "prompt" in row:
        return row["prompt"]
    return tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)


def item_of(row: dict) -> dict:
    """What graders see as ``item``: every field of the row."""
    return row
