"""Grader contract, spec errors, OpenAI-style templates and the grader registry."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from gspo_core.rewards.policy import DEFAULT_POLICY, GraderPolicy
from gspo_core.urls import redact_userinfo

TEMPLATE_RE = re.compile(r"\{\{\s*(item|sample)\.([A-Za-z0-9_.\[\]-]+)\s*\}\}")
#: What a sample carries (OpenAI's grader sample, plus the token count and finish reason): ``output_text`` is
#: the final answer, ``output_json`` that answer parsed as JSON (None when it is not JSON), ``output_tools``
#: the tool calls made (OpenAI's shape), ``messages`` the transcript.
SAMPLE_FIELDS = frozenset({"output_text", "output_json", "output_tokens", "finish_reason", "output_tools", "messages"})
#: Nesting a sample's ``output_json`` may have (deeper answers are not JSON to the graders).
MAX_OUTPUT_JSON_DEPTH = 64
#: The largest magnitude a spec's number takes where its field names no tighter bound (scores, targets, ranges).
MAX_SPEC_NUMBER = 1e15
#: Wall-clock budget of one in-process grader call before the batch stops waiting for it.
LOCAL_BUDGET_S = 30.0
#: Bounds on a reward spec's JSON (nesting depth, values in all), checked before anything recurses into it.
MAX_SPEC_DEPTH = 64
MAX_SPEC_VALUES = 100_000


class RewardSpecError(ValueError):
    """An invalid reward spec; ``field`` is the dotted path of the bad key."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, redact_userinfo(message)  # it may quote a URL (an MCP server's)
        super().__init__(f"{field}: {self.message}")


class GraderError(Exception):
    """A grader failed on one sample; ``kind`` (exception, timeout, invalid_output, memory, killed,
    missing_field, http_error) is recorded with the message."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(redact_userinfo(message))  # recorded and shown: a URL's credentials never are


@dataclass
class GradeResult:
    """The reward of one sample, its per-grader scores and per-grader errors (``kind: message``)."""

    reward: float
    scores: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def output_json(text: str) -> Any:
    """``text`` parsed as JSON (OpenAI's ``sample.output_json``), or None when it is not a JSON object or array
    (or is nested deeper than `MAX_OUTPUT_JSON_DEPTH`, checked before the parser recurses)."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    depth = deepest = 0
    for char in stripped:  # brackets inside strings over-count: a bound, not a parse
        if char in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "}]":
            depth -= 1
    if deepest > MAX_OUTPUT_JSON_DEPTH:
        return None
    try:
        return json.loads(stripped, parse_constant=_no_constant)
    except ValueError:
        return None


def sample_for(
    text: str,
    tokens: int,
    finish_reason: str = "stop",
    tool_calls: list[dict] | None = None,
    messages: list[dict] | None = None,
) -> dict:
    """What graders see as ``sample`` (`SAMPLE_FIELDS`), the trainer's and the dry runs' alike; ``messages``
    defaults to the answer as the one assistant turn."""
    return {
        "output_text": text,
        "output_json": output_json(text),
        "output_tokens": tokens,
        "finish_reason": finish_reason,
        "output_tools": list(tool_calls or []),
        "messages": messages if messages is not None else [{"role": "assistant", "content": text}],
    }


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _split_path(path: str) -> list[str]:
    """``a.b[0].c`` -> ``["a", "b", "0", "c"]``."""
    return [p for p in re.split(r"[.\[\]]+", path) if p]


def _lookup(root: Any, path: str) -> Any:
    cur = root
    for part in _split_path(path):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(path)
    return cur


def render(template: str, sample: dict, item: dict) -> str:
    """Fill ``{{item.x}}``, ``{{item.a.b}}``, ``{{item.xs[0]}}`` and ``{{sample.output_text}}``
    (OpenAI grader template syntax); dicts and lists are written as JSON."""

    def sub(match: re.Match) -> str:
        root = item if match.group(1) == "item" else sample
        try:
            value = _lookup(root, match.group(2))
        except KeyError:
            raise GraderError("missing_field", f"template field {match.group(1)}.{match.group(2)} not found") from None
        if isinstance(value, str):
            return value
        return json.dumps(value) if isinstance(value, (dict, list)) else str(value)

    return TEMPLATE_RE.sub(sub, template)


def item_fields_of(template: str) -> set[str]:
    """Top-level item fields a template references (``{{item.a.b}}`` -> ``a``)."""
    return {_split_path(match.group(2))[0] for match in TEMPLATE_RE.finditer(template) if match.group(1) == "item"}


def as_score(value: Any) -> float:
    """A grader's output as a finite float, or GraderError('invalid_output')."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, dict) and "reward" in value:
        value = value["reward"]
    if isinstance(value, (str, bytes, dict, list, tuple)) or value is None:
        raise GraderError("invalid_output", f"grader returned {type(value).__name__}, not a number")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise GraderError("invalid_output", f"grader returned {type(value).__name__}, not a number") from None
    if not math.isfinite(out):
        raise GraderError("invalid_output", f"grader returned {out}")
    return out


class Grader:
    """Base class: built from a validated spec, ``grade(sample, item) -> float``.

    ``batched`` graders score a whole batch in one ``grade_batch`` call (their own parallelism);
    the others are called once per sample, concurrently, by the reward function.
    """

    type_name = ""
    batched = False

    def __init__(self, spec: dict, path: str, policy: GraderPolicy = DEFAULT_POLICY) -> None:
        self.spec, self.path, self.policy = spec, path, policy
        self.templates: list[str] = []
        self.name = self.opt("name", str, None) or (path.split(".")[-1] if path else "") or self.type_name

    def field(self, key: str) -> str:
        """The dotted path of one of this grader's keys, for error messages."""
        return f"{self.path}.{key}" if self.path else key

    def local_models(self) -> dict[str, str]:
        """``{field: model}`` of the models this grader loads from disk or a hub (the service checks
        them against the same policy as the trained model)."""
        return {}

    def grade(self, sample: dict, item: dict) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def grade_one(self, sample: dict, item: dict) -> float | GraderError:
        """``grade`` with every failure turned into a GraderError (a grader never crashes a job)."""
        try:
            return as_score(self.grade(sample, item))
        except GraderError as exc:
            return exc
        except Exception as exc:
            return GraderError("exception", f"{type(exc).__name__}: {exc}"[:500])

    def grade_batch(self, samples: list[dict], items: list[dict]) -> list[float | GraderError]:
        """Default: one call per sample; batched graders override this."""
        return [self.grade_one(s, it) for s, it in zip(samples, items, strict=True)]

    def budget_s(self, n: int) -> float:
        """How long the reward function waits for one call (``n`` samples) before recording a timeout."""
        return LOCAL_BUDGET_S

    def item_fields(self) -> set[str]:
        """Top-level item fields this grader's templates (given or default) reference."""
        return set().union(*(item_fields_of(template) for template in self.templates)) if self.templates else set()

    def close(self) -> None:
        pass

    # --- spec helpers -------------------------------------------------------------------
    def req(self, key: str, kind: type | tuple = str) -> Any:
        if key not in self.spec or self.spec[key] is None:
            raise RewardSpecError(self.field(key), "is required")
        return self.opt(key, kind, None)

    def opt(self, key: str, kind: type | tuple, default: Any) -> Any:
        value = self.spec.get(key, default)
        if value is None:
            return default
        bad_bool = isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
        if bad_bool or not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise RewardSpecError(self.field(key), f"must be {names.replace('int/float', 'a number')}")
        return value

    def num(self, key: str, default: float | None, lo: float | None = None, hi: float | None = None) -> Any:
        """An optional number within [lo, hi]; an open side stops at :data:`MAX_SPEC_NUMBER` (compared before
        any conversion: float() of a 400-digit integer raises, and 1e308 overflows the first sum)."""
        value = self.opt(key, (int, float), default)
        lo = -MAX_SPEC_NUMBER if lo is None else lo
        hi = MAX_SPEC_NUMBER if hi is None else hi
        if value is not None and not lo <= value <= hi:  # NaN fails too
            raise RewardSpecError(self.field(key), f"must be a number in [{lo:g}, {hi:g}]")
        return value

    @overload
    def tmpl(self, key: str, default: str, required: bool = False) -> str: ...

    @overload
    def tmpl(self, key: str, default: None = None, *, required: Literal[True]) -> str: ...

    @overload
    def tmpl(self, key: str, default: None = None, required: bool = False) -> str | None: ...

    def tmpl(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        """A template string: checked (only known sample fields) and remembered for item_fields()."""
        value = self.req(key, str) if required else self.opt(key, str, default)
        if value is not None:
            self.add_template(value, key)
        return value

    def add_template(self, value: str, key: str) -> None:
        for match in TEMPLATE_RE.finditer(value):
            if match.group(1) == "sample" and _split_path(match.group(2))[0] not in SAMPLE_FIELDS:
                raise RewardSpecError(
                    self.field(key),
                    f"unknown sample field {match.group(2)!r}; known: " + ", ".join(sorted(SAMPLE_FIELDS)),
                )
        self.templates.append(value)

    def check_keys(self, allowed: set[str]) -> None:
        for key in self.spec:
            if key not in allowed | {"type", "name"}:
                raise RewardSpecError(self.field(key), f"unknown field for a {self.type_name} grader")


GRADERS: dict[str, type[Grader]] = {}


def register(type_name: str) -> Callable[[type[Grader]], type[Grader]]:
    """Class decorator: make a grader available to specs as ``{"type": type_name}``."""

    def deco(cls: type[Grader]) -> type[Grader]:
        cls.type_name = type_name
        GRADERS[type_name] = cls
        return cls

    return deco


def check_spec_values(spec: Any) -> None:
    """Refuse, naming the field, a spec nested deeper than ``MAX_SPEC_DEPTH``, larger than
    ``MAX_SPEC_VALUES`` values, or holding a non-finite number (JSON's NaN/Infinity extensions).
    Iterative, so no spec can exhaust the stack here."""
    stack: list[tuple[Any, str, int]] = [(spec, "", 0)]
    seen = 0
    while stack:
        value, path, depth = stack.pop()
        seen += 1
        if seen > MAX_SPEC_VALUES:
            raise RewardSpecError("reward", f"more than {MAX_SPEC_VALUES} values")
        if isinstance(value, float) and not math.isfinite(value):
            raise RewardSpecError(path or "reward", "must be a finite number")
        if isinstance(value, (dict, list)):
            if depth >= MAX_SPEC_DEPTH:
                raise RewardSpecError(path or "reward", f"nested deeper than {MAX_SPEC_DEPTH} levels")
            pairs = value.items() if isinstance(value, dict) else enumerate(value)
            for key, sub in pairs:
                sub_path = f"{path}[{key}]" if isinstance(value, list) else (f"{path}.{key}" if path else str(key))
                stack.append((sub, sub_path, depth + 1))


def json_depth(value: Any) -> int:
    """Nesting depth of dicts/lists (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d + 1)
            stack.extend((sub, d + 1) for sub in (v.values() if isinstance(v, dict) else v))
    return deepest


def build_grader(spec: Any, path: str, policy: GraderPolicy = DEFAULT_POLICY) -> Grader:
    """Build one grader from its spec (dispatch through the registry), under the operator's ``policy``."""
    if not isinstance(spec, dict):
        raise RewardSpecError(path or "reward", "a grader spec must be a JSON object")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in GRADERS:
        known = ", ".join(sorted(GRADERS))
        raise RewardSpecError(f"{path}.type" if path else "type", f"unknown grader type {kind!r}; known: {known}")
    return GRADERS[kind](spec, path, policy)


#: Spec keys whose value is a credential (``score_model.api_key``), and keys whose every value may be
#: one (``http.headers``, e.g. ``Authorization``): the worker needs them, nobody needs to read them back.
SECRET_KEYS = frozenset({"api_key"})
SECRET_MAPS = frozenset({"headers"})
REDACTED = "[redacted]"


def redact_secrets(spec: Any) -> Any:
    """A copy of a reward spec with credentials replaced by ``REDACTED``, at any nesting depth: those under
    :data:`SECRET_KEYS` and :data:`SECRET_MAPS`, and the userinfo of every URL in a string."""
    if isinstance(spec, list):
        return [redact_secrets(v) for v in spec]
    if isinstance(spec, str):
        return redact_userinfo(spec)
    if not isinstance(spec, dict):
        return spec
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if key in SECRET_KEYS and isinstance(value, str):
            out[key] = REDACTED
        elif key in SECRET_MAPS and isinstance(value, dict):
            out[key] = dict.fromkeys(value, REDACTED)
        else:
            out[key] = redact_secrets(value)
    return out
