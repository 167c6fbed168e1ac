"""Grader contract, spec errors, templates and the grader registry."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

TEMPLATE_RE = re.compile(r"\{\{\s*(item|sample)\.([A-Za-z0-9_.\[\]-]+)\s*\}\}")


class RewardSpecError(ValueError):
    """An invalid reward spec; ``field`` is the dotted path of the bad key."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


class GraderError(Exception):
    """A grader failed on one sample; ``kind`` is recorded (exception, timeout, invalid_output, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


@dataclass
class GradeResult:
    """The reward of one sample, its per-grader scores and per-grader errors (``kind: message``)."""

    reward: float
    scores: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def _lookup(root: Any, path: str) -> Any:
    cur = root
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(path)
    return cur


def render(template: str, sample: dict, item: dict) -> str:
    """Fill ``{{item.x}}`` / ``{{sample.output_text}}`` (OpenAI grader template syntax)."""

    def sub(m: re.Match) -> str:
        root = item if m.group(1) == "item" else sample
        try:
            value = _lookup(root, m.group(2))
        except KeyError:
            raise GraderError("missing_field", f"template field {m.group(1)}.{m.group(2)} not found") from None
        return value if isinstance(value, str) else str(value)

    return TEMPLATE_RE.sub(sub, template)


def item_fields_of(value: Any) -> set[str]:
    """Top-level item fields referenced by any template inside ``value`` (str, list, dict)."""
    if isinstance(value, str):
        return {m.group(2).split(".")[0] for m in TEMPLATE_RE.finditer(value) if m.group(1) == "item"}
    if isinstance(value, dict):
        return set().union(*(item_fields_of(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(item_fields_of(v) for v in value)) if value else set()
    return set()


def as_score(value: Any) -> float:
    """A grader's output as a finite float, or GraderError('invalid_output')."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, dict) and "reward" in value:
        value = value["reward"]
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise GraderError("invalid_output", f"grader returned {type(value).__name__}, not a number") from None
    if not math.isfinite(out):
        raise GraderError("invalid_output", f"grader returned {out}")
    return out


class Grader:
    """Base class: built from a validated spec, ``grade(sample, item) -> float``."""

    type_name = ""

    def __init__(self, spec: dict, path: str) -> None:
        self.spec, self.path = spec, path
        self.name = spec.get("name") or (path.split(".")[-1] if path else "") or self.type_name

    def field(self, key: str) -> str:
        """The dotted path of one of this grader's keys, for error messages."""
        return f"{self.path}.{key}" if self.path else key

    def grade(self, sample: dict, item: dict) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def grade_batch(self, samples: list[dict], items: list[dict]) -> list[float | GraderError]:
        """Default: one call per sample; graders with a batched backend override this."""
        out: list[float | GraderError] = []
        for s, it in zip(samples, items):
            try:
                out.append(as_score(self.grade(s, it)))
            except GraderError as exc:
                out.append(exc)
            except Exception as exc:  # a grader error scores 0; it never crashes the job
                out.append(GraderError("exception", f"{type(exc).__name__}: {exc}"))
        return out

    def close(self) -> None:
        pass

    # --- spec helpers -------------------------------------------------------------------
    def req(self, key: str, kind: type | tuple = str) -> Any:
        if key not in self.spec:
            raise RewardSpecError(self.field(key), "is required")
        return self.opt(key, kind, None)

    def opt(self, key: str, kind: type | tuple, default: Any) -> Any:
        value = self.spec.get(key, default)
        if value is not None and not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise RewardSpecError(self.field(key), f"must be {names}")
        return value

    def check_keys(self, allowed: set[str]) -> None:
        for key in self.spec:
            if key not in allowed | {"type", "name", "weight"}:
                raise RewardSpecError(self.field(key), f"unknown field for a {self.type_name} grader")


GRADERS: dict[str, type[Grader]] = {}


def register(type_name: str) -> Callable[[type[Grader]], type[Grader]]:
    def deco(cls: type[Grader]) -> type[Grader]:
        cls.type_name = type_name
        GRADERS[type_name] = cls
        return cls

    return deco


def build_grader(spec: Any, path: str) -> Grader:
    """Build one grader from its spec (dispatch through the registry)."""
    if not isinstance(spec, dict):
        raise RewardSpecError(path or "reward", "a grader spec must be a JSON object")
    kind = spec.get("type")
    if kind not in GRADERS:
        known = ", ".join(sorted(GRADERS))
        raise RewardSpecError(f"{path}.type" if path else "type", f"unknown grader type {kind!r}; known: {known}")
    return GRADERS[kind](spec, path)
