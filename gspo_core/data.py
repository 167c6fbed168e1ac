"""Prompt datasets: JSONL validation with line numbers, loading, and prompt rendering.

Also the strict JSON the service accepts anywhere (dataset rows and API request bodies): nesting
bounded before any recursive parse, finite numbers only, integers of bounded length.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.config import JobSpec

#: Deepest JSON nesting accepted in a dataset row or a request body (chat rows use 3).
MAX_DEPTH = 32
#: Longest integer literal accepted (Python itself refuses to convert past 4300 digits).
MAX_INT_DIGITS = 1000
#: Most top-level fields a dataset row may have.
MAX_ROW_FIELDS = 256
#: Roles a supervised (chat) row's messages may have.
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Longest dataset line (bytes) the service accepts by default; it bounds a row's width.
MAX_ROW_BYTES = 1 << 20

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


class DataError(ValueError):
    """A bad dataset row: ``line`` is 1-based (None for whole-file problems), ``field`` names the key."""

    def __init__(self, line: int | None, field: str | None, message: str) -> None:
        self.line, self.field, self.message = line, field, message
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{message}")


class JsonValueError(ValueError):
    """JSON that parses but is refused: too deep, a non-finite number, an over-long integer.
    ``path`` names where (``a.b[2]``; empty for the document itself or when it cannot be told)."""

    def __init__(self, message: str, path: str = "") -> None:
        self.message, self.path = message, path
        super().__init__(f"{path}: {message}" if path else message)


def nesting_exceeds(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON text nests deeper than ``limit``, decided with byte operations only (no parse, no
    recursion): strings are cut out, brackets kept, and each pass drops the innermost ``[]`` pairs
    (a run of ``limit + 1`` openers settles it at once)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", raw).translate(_BRACKETS, _NOT_BRACKETS)
    run = b"[" * (limit + 1)
    for _ in range(limit):
        if run in brackets:
            return True
        inner_removed = brackets.replace(b"[]", b"")
        if len(inner_removed) == len(brackets):
            break
        brackets = inner_removed
    # What is left: pairs deeper than `limit`, or unbalanced brackets (JSON the parser refuses).
    opener = brackets.find(b"[")
    return opener >= 0 and brackets.find(b"]", opener) >= 0


class _Refused:
    """Stands in for a refused number while parsing, so that its path can be found afterwards."""

    def __init__(self, why: str) -> None:
        self.why = why


def _path_of(obj: Any, test) -> tuple[str, Any] | None:
    """``(path, value)`` of the first value (depth first) for which ``test(value, depth)`` holds."""
    stack: list[tuple[str, Any, int]] = [("", obj, 0)]
    while stack:
        path, value, depth = stack.pop()
        if test(value, depth):
            return path, value
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), v, depth + 1) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v, depth + 1) for i, v in reversed(list(enumerate(value)))]
    return None


def _deep_path(raw: str | bytes, limit: int) -> str:
    """Where a too-deep document first passes ``limit`` (empty when even locating it would recurse too far)."""
    try:
        obj = json.loads(raw)
    except (RecursionError, ValueError):
        return ""
    found = _path_of(obj, lambda v, d: d >= limit and isinstance(v, (dict, list)))
    return found[0] if found else ""


def _not_unicode(value: Any) -> bool:
    """A string (or a dict with a key) holding a lone surrogate (``"\\ud800"``): JSON can spell it,
    UTF-8 cannot, so it breaks whatever stores or sends it on."""
    texts = value.keys() if isinstance(value, dict) else (value,) if isinstance(value, str) else ()
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return True
    return False


def _parse_int(text: str):
    digits = len(text) - text.startswith("-")
    return (
        int(text) if digits <= MAX_INT_DIGITS else _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    )


def _parse_float(text: str):
    value = float(text)
    return value if value - value == 0.0 else _Refused(f"{text[:40]} is out of range (numbers must be finite)")


def _parse_constant(name: str):
    return _Refused(f"{name} is not allowed (numbers must be finite)")


def loads_strict(raw: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` for untrusted input: :class:`JsonValueError` (naming the path) for nesting past
    ``max_depth``, NaN/Infinity or a float that overflows, an integer longer than ``MAX_INT_DIGITS``;
    ``json.JSONDecodeError`` for text that is not JSON."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if nesting_exceeds(data, max_depth):
        raise JsonValueError(f"nested deeper than {max_depth} levels", _deep_path(raw, max_depth))
    refused: list[_Refused] = []

    def note(value):
        if isinstance(value, _Refused):
            refused.append(value)
        return value

    try:
        obj = json.loads(
            raw,
            parse_int=lambda t: note(_parse_int(t)),
            parse_float=lambda t: note(_parse_float(t)),
            parse_constant=lambda t: note(_parse_constant(t)),
        )
    except RecursionError:  # unbalanced brackets can open deeper than the byte check counts
        raise JsonValueError(f"nested deeper than {max_depth} levels") from None
    if refused:
        found = _path_of(obj, lambda v, d: isinstance(v, _Refused))
        path, value = found if found is not None else ("", refused[0])  # it is found: it was parsed into obj
        raise JsonValueError(value.why, path)
    if _SURROGATE.search(data) and (found := _path_of(obj, lambda v, d: _not_unicode(v))):
        raise JsonValueError("a string holds a lone UTF-16 surrogate escape (not valid Unicode)", found[0])
    return obj


def row_tool_names(row: dict) -> frozenset[str] | None:
    """The names of the tools a row offers (its ``tools``, OpenAI's dataset format); None: the job's all."""
    tools = row.get("tools")
    if not isinstance(tools, list):
        return None
    return frozenset(t["function"]["name"] for t in tools)


def _check_row_tools(tools: Any, line: int) -> None:
    """A row's ``tools``: OpenAI's ``[{"type": "function", "function": {"name": ...}}]``."""
    if not isinstance(tools, list):
        raise DataError(line, "tools", '`tools` must be a list of {"type": "function", "function": {"name": ...}}')
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise DataError(line, f"tools[{i}]", 'each tool is {"type": "function", "function": {"name": ...}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise DataError(line, f"tools[{i}].function.name", "must be the name of one of the job's tools")


def check_row_tools(rows: Iterable[tuple[int, dict]], names: set[str]) -> None:
    """Every tool a row names (``(line, row)`` pairs) is one of the job's (``names``); :class:`DataError`
    naming the line and the field of the first that is not."""
    for line, row in rows:
        for i, tool in enumerate(row.get("tools") or ()):
            if (name := tool["function"]["name"]) not in names:
                known = ", ".join(sorted(names)) or "none"
                raise DataError(
                    line, f"tools[{i}].function.name", f"no tool named {name!r} in the job (it has: {known})"
                )


def rows_with_tools(chunks: Iterable[bytes]) -> Iterator[tuple[int, dict]]:
    """``(line, row)`` of the rows that carry ``tools`` in a stored JSONL file (validated at upload) read as
    byte chunks; memory holds one line at a time, and only the lines that mention ``"tools"`` are parsed."""
    line, rest = 0, b""
    for chunk in itertools.chain(chunks, [b"\n"]):  # the last line may lack its newline
        *lines, rest = (rest + chunk).split(b"\n")
        for raw in lines:
            line += 1
            if b'"tools"' not in raw:
                continue
            row = loads_strict(raw.decode("utf-8-sig" if line == 1 else "utf-8"))
            if isinstance(row, dict) and "tools" in row:
                yield line, row


def _check_row(row: Any, line: int) -> dict:
    if not isinstance(row, dict):
        raise DataError(line, None, f"expected a JSON object, got {type(row).__name__}")
    if len(row) > MAX_ROW_FIELDS:
        raise DataError(line, None, f"row has {len(row)} fields; at most {MAX_ROW_FIELDS}")
    if "tools" in row:
        _check_row_tools(row["tools"], line)
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DataError(line, "prompt", "`prompt` must be a non-empty string")
        return row
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(line, "messages", "`messages` must be a non-empty list")
        for i, message in enumerate(msgs):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise DataError(line, f"messages[{i}]", "each message needs string `role` and `content`")
        return row
    raise DataError(line, "prompt", "row has neither `prompt` (text) nor `messages` (chat)")


def check_sft_row(row: Any, line: int) -> None:
    """A supervised row: OpenAI's chat ``messages``, at least one assistant message trained on, ``weight``
    (0 or 1) only on assistant messages. :class:`DataError` names the line and the field."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(line, "messages", "supervised rows need `messages`: a non-empty list of chat messages")
    trained = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(line, where, "each message needs string `role` and `content`")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(line, f"{where}.role", f"role {role!r} is not one of {', '.join(ROLES)}")
        weight = message.get("weight", 1)
        if "weight" in message and role != "assistant":
            raise DataError(line, f"{where}.weight", "only assistant messages take a `weight`")
        if isinstance(weight, bool) or weight not in (0, 1):
            raise DataError(line, f"{where}.weight", f"`weight` is 0 or 1, got {weight!r}")
        trained += role == "assistant" and weight == 1
    if not trained:
        raise DataError(line, "messages", "no assistant message to train on (none, or all have weight 0)")


def check_sft_file(f: IO[bytes]) -> int:
    """Check every row of a JSONL stream (already parsed once at upload) as a supervised row; returns the rows."""
    rows = 0
    for line, raw in enumerate(f, 1):
        if raw.strip():
            check_sft_row(loads_strict(raw.decode("utf-8-sig" if line == 1 else "utf-8")), line)
            rows += 1
    return rows


def _parse_line(raw: bytes, lineno: int, offset: int) -> Any:
    """One line's JSON value (``offset``: the line's first byte in the file, for UTF-8 errors)."""
    try:
        text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate the BOM some editors write
    except UnicodeDecodeError as exc:
        raise DataError(lineno, None, f"file is not valid UTF-8 (byte {offset + exc.start})") from None
    try:
        return loads_strict(text)
    except JsonValueError as exc:
        raise DataError(lineno, exc.path or None, f"not accepted: {exc}") from None
    except ValueError as exc:  # json.JSONDecodeError, or a number Python refuses to convert
        detail = f"{exc.msg} (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise DataError(lineno, None, f"not valid JSON: {detail}") from None


def iter_jsonl(f: BinaryIO, *, max_rows: int = 1_000_000, max_row_bytes: int | None = MAX_ROW_BYTES) -> Iterator[dict]:
    """Validated rows of a JSONL stream, read line by line (memory bounded by the longest line, which
    is at most ``max_row_bytes``; None: unbounded). Raises :class:`DataError` naming the line and field."""
    rows = offset = 0
    # Split on b"\n" only: str.splitlines() would also break inside JSON strings holding U+2028 etc.
    for lineno in range(1, 1 << 62):
        raw = f.readline(max_row_bytes + 1) if max_row_bytes else f.readline()
        if not raw:
            break
        if max_row_bytes and len(raw) > max_row_bytes and not raw.endswith(b"\n"):
            raise DataError(lineno, None, f"line is longer than {max_row_bytes} bytes")
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        obj = _parse_line(raw, lineno, start)
        if rows == max_rows:
            raise DataError(lineno, None, f"too many rows: the limit is {max_rows}")
        rows += 1
        yield _check_row(obj, lineno)
    if not rows:
        raise DataError(None, None, "file is empty: it needs at least one JSON object line")


def jsonl_summary(
    f: BinaryIO, *, max_rows: int = 1_000_000, max_row_bytes: int | None = MAX_ROW_BYTES
) -> tuple[int, list[str]]:
    """``(rows, fields every row has)`` of a JSONL stream validated by :func:`iter_jsonl`, keeping no row."""
    rows, common = 0, None
    for row in iter_jsonl(f, max_rows=max_rows, max_row_bytes=max_row_bytes):
        rows += 1
        common = set(row) if common is None else common & row.keys()
    return rows, sorted(common or ())


def validate_jsonl_bytes(data: bytes, *, max_rows: int = 1_000_000) -> list[dict]:
    """Parse and validate a JSONL upload; raise :class:`DataError` naming the line and field."""
    return list(iter_jsonl(io.BytesIO(data), max_rows=max_rows, max_row_bytes=None))


def load_rows(source: str, *, max_rows: int = 10_000_000) -> list[dict]:
    """Rows from a JSONL path, or ``hf:name[:config]:split`` through `datasets` when installed."""
    if source.startswith("hf:"):
        return _load_hf(source[3:])
    path = Path(source)
    if not path.is_file():
        raise DataError(None, None, f"dataset file not found: {source}")
    with open(path, "rb") as f:
        return list(iter_jsonl(f, max_rows=max_rows, max_row_bytes=None))


def spec_rows(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    """A job's ``(training rows, validation rows)``: its files', or its environment's generated items (the
    same item dicts a JSONL row is, so the loop does not tell them apart)."""
    if spec.environment is not None:
        from gspo_core.environments import check_environment, environment_rows

        return environment_rows(check_environment(spec.environment))
    assert spec.training_file is not None, "a JobSpec has files or an environment"
    return load_rows(spec.training_file), load_rows(spec.validation_file) if spec.validation_file else []


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


def render_prompt(row: dict, tokenizer: PreTrainedTokenizerBase, tools: list[dict] | None = None) -> str:
    """The prompt text of a row: ``prompt`` as is, or ``messages`` through the chat template, offered the
    job's ``tools`` (their schemas) where it has any, narrowed to the row's own ``tools`` where it has them."""
    if "prompt" in row:
        return row["prompt"]
    if tools and (names := row_tool_names(row)) is not None:  # the row narrows the job's tools
        tools = [tool for tool in tools if tool["function"]["name"] in names]
    text = tokenizer.apply_chat_template(
        row["messages"], tools=tools or None, tokenize=False, add_generation_prompt=True
    )
    return cast(str, text)  # tokenize=False: the rendered text


def item_of(row: dict) -> dict:
    """What graders see as ``item``: every field of the row."""
    return row
