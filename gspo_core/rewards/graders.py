"""Local, deterministic graders: string_check, regex, math_answer, json_schema, length, text_similarity."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import ClassVar

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, json_depth, register, render
from gspo_core.rewards.policy import DEFAULT_POLICY
from gspo_core.rewards.pool import Killable
from gspo_core.rewards.similarity import METRICS

OUTPUT = "{{sample.output_text}}"


@register("string_check")
class StringCheck(Grader):
    """OpenAI's string check: eq, ne, like (contains), ilike (contains, case-insensitive)."""

    OPS: ClassVar[dict[str, Callable[[str, str], bool]]] = {
        "eq": lambda a, b: a == b,
        "ne": lambda a, b: a != b,
        "like": lambda a, b: b in a,
        "ilike": lambda a, b: b.lower() in a.lower(),
    }

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"input", "reference", "operation"})
        self.input = self.tmpl("input", OUTPUT)
        self.reference = self.tmpl("reference", required=True)
        self.op = self.req("operation", str)
        if self.op not in self.OPS:
            raise RewardSpecError(self.field("operation"), f"must be one of {', '.join(self.OPS)}")

    def grade(self, sample, item):
        return float(self.OPS[self.op](render(self.input, sample, item), render(self.reference, sample, item)))


def _regex_engine():
    """The ``regex`` module (a transformers dependency) when present: it can time out a
    catastrophically backtracking pattern, which ``re`` cannot (and ``re`` holds the GIL)."""
    try:
        import regex

        return regex
    except ImportError:  # pragma: no cover - transformers always brings it
        return None


@register("regex")
class RegexGrader(Grader):
    """``score_match`` (1.0) when ``pattern`` matches the input (``mode``: search | match |
    fullmatch), else ``score_no_match`` (0.0). The pattern may itself be a template."""

    FLAGS: ClassVar[dict[str, re.RegexFlag]] = {"i": re.I, "m": re.M, "s": re.S, "x": re.X}

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"input", "pattern", "mode", "flags", "score_match", "score_no_match", "timeout_s"})
        self.input = self.tmpl("input", OUTPUT)
        self.pattern_t = self.tmpl("pattern", required=True)
        self.mode = self.opt("mode", str, "search")
        if self.mode not in ("search", "match", "fullmatch"):
            raise RewardSpecError(self.field("mode"), "must be search, match or fullmatch")
        self.flags = 0
        for ch in self.opt("flags", str, ""):
            if ch not in self.FLAGS:
                raise RewardSpecError(self.field("flags"), "letters i, m, s, x only")
            self.flags |= self.FLAGS[ch]
        self.on = self.num("score_match", 1.0)
        self.off = self.num("score_no_match", 0.0)
        self.timeout = float(self.num("timeout_s", 1.0, 0.001, 30))
        self.engine = _regex_engine() or re
        self.compiled = None if "{{" in self.pattern_t else self._compile(self.pattern_t, spec_error=True)

    def _compile(self, pattern: str, spec_error: bool = False):
        try:
            re.compile(pattern, self.flags)  # the documented syntax is Python's re
            return self.engine.compile(pattern, self.flags)
        except (re.error, ValueError, OverflowError, RecursionError) as exc:
            if spec_error:
                raise RewardSpecError(self.field("pattern"), f"invalid regex: {exc}") from None
            raise GraderError("exception", f"rendered pattern is not a valid regex: {exc}") from None

    def grade(self, sample, item):
        pat = self.compiled or self._compile(render(self.pattern_t, sample, item))
        text = render(self.input, sample, item)
        kwargs = {"timeout": self.timeout} if self.engine is not re else {}
        try:
            hit = getattr(pat, self.mode)(text, **kwargs)
        except TimeoutError:
            raise GraderError("timeout", f"pattern took longer than {self.timeout:g} s") from None
        return float(self.on if hit else self.off)


_BOXED = re.compile(r"\\boxed\s*\{")
_BRACES = re.compile(r"[{}]")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
#: Minus signs besides ASCII '-' (U+2212 minus, small and full-width hyphen-minus); an en dash is left
#: alone, as "3\u20135" is a range more often than a subtraction.
_MINUSES = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` to close, at any nesting depth (one pass over the braces)."""
    opens = {match.end() - 1 for match in _BOXED.finditer(text)}  # where each box's "{" is
    found, stack = None, []
    for brace in _BRACES.finditer(text) if opens else ():
        if brace.group() == "{":
            stack.append(brace.start())
        elif stack:
            start = stack.pop()
            if start in opens:
                found = text[start + 1 : brace.start()]
    return found


def extract_answer(text: str) -> str | None:
    """The final answer: the last ``\\boxed{}`` content, else the last number in the text."""
    text = text.translate(_MINUSES)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "") if nums else None


#: Cheap shapes sympy would evaluate into astronomically large numbers: an exponent holding another
#: exponent (9^{9^{9}}, 9^9^9), an exponent of 6+ digits, a factorial of a 4+ digit number.
_HUGE = re.compile(r"(\^|\*\*)\s*(\{[^{}]*(\^|\*\*)|[\w.]+\s*(\^|\*\*))|(\^|\*\*)\s*[{(]?\s*\d{6,}|\d{4,}\s*!")


def _too_big(expr: str) -> bool:
    return _HUGE.search(expr) is not None


def _to_float(s: str) -> float | None:
    s = s.replace(",", "").replace("$", "").strip()
    try:
        if "/" in s:
            a, b = s.split("/", 1)
            return float(a) / float(b)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


@register("math_answer")
class MathAnswer(Killable):
    """Equivalence of the final answer (last ``\\boxed{}`` or last number) and the reference:
    math-verify's parse/verify for LaTeX and symbolic answers, numeric tolerance as the fallback."""

    MAX_CHARS = 2000  # sympy on an adversarial expression can take unbounded time

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"input", "reference", "tolerance"})
        self.input = self.tmpl("input", OUTPUT)
        self.reference = self.tmpl("reference", required=True)
        self.tol = float(self.num("tolerance", 1e-6, 0, 1e6))
        self.start_pool()

    def grade(self, sample, item):
        answer = extract_answer(render(self.input, sample, item))
        ref = render(self.reference, sample, item).strip().translate(_MINUSES)
        if answer is None:
            return 0.0
        a, b = _to_float(answer), _to_float(ref)
        if a is not None and b is not None:
            return float(abs(a - b) <= self.tol * max(1.0, abs(b)))
        if max(len(answer), len(ref)) > self.MAX_CHARS:
            raise GraderError("invalid_output", f"answer or reference longer than {self.MAX_CHARS} characters")
        if _too_big(answer) or _too_big(ref):
            raise GraderError(
                "invalid_output", "answer too large to verify (a power tower, a huge exponent or factorial)"
            )
        from math_verify import parse, verify

        # The pool process's alarm (GraderPolicy.local_timeout_s) bounds these; math-verify's own
        # timeouts are off (they would take over the same SIGALRM).
        gold, pred = parse(f"${ref}$", parsing_timeout=None), parse(f"${answer}$", parsing_timeout=None)
        if gold and pred and verify(gold, pred, timeout_seconds=None):
            return 1.0
        return float(a is not None and b is not None and abs(a - b) <= self.tol * max(1.0, abs(b)))


@register("json_schema")
class JsonSchemaGrader(Killable):
    """1.0 when the output parses as JSON and validates against ``schema`` (Draft 2020-12);
    ``partial_credit`` for valid JSON that fails the schema (default 0). Code fences are stripped."""

    _FENCE = re.compile(r"^```(?:json)?\s*\n(.*)\n```$", re.S)
    MAX_SCHEMA_DEPTH = 32
    MAX_CHARS = 1_000_000

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"input", "schema", "partial_credit"})
        import jsonschema

        self.input = self.tmpl("input", OUTPUT)
        schema = self.req("schema", dict)
        if json_depth(schema) > self.MAX_SCHEMA_DEPTH:
            raise RewardSpecError(self.field("schema"), f"nested deeper than {self.MAX_SCHEMA_DEPTH} levels")
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise RewardSpecError(self.field("schema"), f"invalid JSON schema: {exc.message}") from None
        except RecursionError:
            raise RewardSpecError(self.field("schema"), "nested too deeply") from None
        self.validator = jsonschema.Draft202012Validator(schema)
        self.partial = float(self.num("partial_credit", 0.0, 0, 1))
        self.start_pool()

    def grade(self, sample, item):
        text = render(self.input, sample, item).strip()
        if len(text) > self.MAX_CHARS:
            raise GraderError("invalid_output", f"input longer than {self.MAX_CHARS} characters")
        fenced = self._FENCE.match(text)
        try:
            value = json.loads(fenced.group(1) if fenced else text)
        except (json.JSONDecodeError, RecursionError):
            return 0.0
        return 1.0 if self.validator.is_valid(value) else self.partial


@register("length")
class LengthGrader(Grader):
    """Shaped length score in chars, words or tokens (``sample.output_tokens``): with ``target``,
    1 - |n - target| / tolerance; with ``min``/``max``, 1 inside the range and a linear decay to 0
    over ``tolerance`` outside it."""

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"input", "unit", "min", "max", "target", "tolerance"})
        self.input = self.tmpl("input", OUTPUT)
        self.unit = self.opt("unit", str, "chars")
        if self.unit not in ("chars", "tokens", "words"):
            raise RewardSpecError(self.field("unit"), "must be chars, tokens or words")
        self.target = self.num("target", None, 0)
        self.lo, self.hi = self.num("min", None, 0), self.num("max", None, 0)
        if self.target is not None and (self.lo is not None or self.hi is not None):
            raise RewardSpecError(self.field("target"), "give either target or min/max, not both")
        if self.target is None and self.lo is None and self.hi is None:
            raise RewardSpecError(self.field("target"), "give target, min, max, or min and max")
        if self.lo is not None and self.hi is not None and self.hi < self.lo:
            raise RewardSpecError(self.field("max"), "must be >= min")
        scale = self.target if self.target is not None else (self.hi or self.lo or 1)
        self.tol = float(self.num("tolerance", max(1.0, scale * 0.5), 1e-9))

    def grade(self, sample, item):
        if self.unit == "tokens":
            n = float(sample.get("output_tokens", 0))
        else:
            text = render(self.input, sample, item)
            n = float(len(text) if self.unit == "chars" else len(text.split()))
        if self.target is not None:
            gap = abs(n - self.target)
        elif self.lo is not None and n < self.lo:
            gap = self.lo - n
        elif self.hi is not None and n > self.hi:
            gap = n - self.hi
        else:
            gap = 0.0
        return max(0.0, 1.0 - gap / self.tol)


@register("text_similarity")
class TextSimilarity(Killable):
    """Similarity of input and reference; ``evaluation_metric`` as OpenAI names them (fuzzy_match,
    bleu, gleu, rouge_1..rouge_5, rouge_l) plus exact; ``pass_threshold`` turns it into 0/1."""

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"input", "reference", "evaluation_metric", "pass_threshold"})
        self.input = self.tmpl("input", OUTPUT)
        self.reference = self.tmpl("reference", required=True)
        self.metric = self.opt("evaluation_metric", str, "fuzzy_match")
        if self.metric not in METRICS:
            raise RewardSpecError(self.field("evaluation_metric"), f"must be one of {', '.join(METRICS)}")
        self.threshold = self.num("pass_threshold", None, 0, 1)
        self.start_pool()

    MAX_CHARS = 200_000  # per side; the metrics are quadratic (the pool's deadline bounds the rest)

    def grade(self, sample, item):
        a, b = render(self.input, sample, item), render(self.reference, sample, item)
        if max(len(a), len(b)) > self.MAX_CHARS:
            raise GraderError("invalid_output", f"input or reference longer than {self.MAX_CHARS} characters")
        score = METRICS[self.metric](a, b)
        return float(score >= self.threshold) if self.threshold is not None else float(score)
