"""Local, deterministic graders: string_check, regex, math_answer, json_schema, length, text_similarity."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections import Counter

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, register, render

OUTPUT = "{{sample.output_text}}"


@register("string_check")
class StringCheck(Grader):
    """OpenAI's string check: eq, ne, like (substring), ilike (case-insensitive substring)."""

    OPS = {
        "eq": lambda a, b: a == b,
        "ne": lambda a, b: a != b,
        "like": lambda a, b: b in a,
        "ilike": lambda a, b: b.lower() in a.lower(),
    }

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"input", "reference", "operation"})
        self.input = self.opt("input", str, OUTPUT)
        self.reference = self.req("reference", str)
        self.op = self.req("operation", str)
        if self.op not in self.OPS:
            raise RewardSpecError(self.field("operation"), f"must be one of {', '.join(self.OPS)}")

    def grade(self, sample, item):
        return float(self.OPS[self.op](render(self.input, sample, item), render(self.reference, sample, item)))


@register("regex")
class RegexGrader(Grader):
    """1.0 (``score_match``) when ``pattern`` matches the input, else ``score_no_match`` (0.0)."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"input", "pattern", "mode", "flags", "score_match", "score_no_match"})
        self.input = self.opt("input", str, OUTPUT)
        self.pattern_t = self.req("pattern", str)
        self.mode = self.opt("mode", str, "search")
        if self.mode not in ("search", "match", "fullmatch"):
            raise RewardSpecError(self.field("mode"), "must be search, match or fullmatch")
        flags = 0
        for ch in self.opt("flags", str, ""):
            if ch not in "imsx":
                raise RewardSpecError(self.field("flags"), "letters i, m, s, x only")
            flags |= {"i": re.I, "m": re.M, "s": re.S, "x": re.X}[ch]
        self.flags = flags
        self.on, self.off = self.opt("score_match", (int, float), 1.0), self.opt("score_no_match", (int, float), 0.0)
        if "{{" not in self.pattern_t:
            try:
                self.compiled = re.compile(self.pattern_t, flags)
            except re.error as exc:
                raise RewardSpecError(self.field("pattern"), f"invalid regex: {exc}") from None

    def grade(self, sample, item):
        if "{{" in self.pattern_t:
            pat = re.compile(render(self.pattern_t, sample, item), self.flags)
        else:
            pat = self.compiled
        hit = getattr(pat, self.mode)(render(self.input, sample, item))
        return float(self.on if hit else self.off)


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The final answer: the last ``\\boxed{}`` content, else the last number in the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "") if nums else None


def _to_float(s: str) -> float | None:
    try:
        if "/" in s:
            a, b = s.split("/", 1)
            return float(a) / float(b)
        return float(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


@register("math_answer")
class MathAnswer(Grader):
    """Mathematical equivalence of the final answer and the reference (math-verify, then numeric)."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"input", "reference", "tolerance"})
        self.input = self.opt("input", str, OUTPUT)
        self.reference = self.req("reference", str)
        self.tol = float(self.opt("tolerance", (int, float), 1e-6))

    def grade(self, sample, item):
        answer = extract_answer(render(self.input, sample, item))
        ref = render(self.reference, sample, item).strip()
        if answer is None:
            return 0.0
        a, b = _to_float(answer), _to_float(ref)
        if a is not None and b is not None:
            return float(abs(a - b) <= self.tol * max(1.0, abs(b)))
        try:
            from math_verify import parse, verify
        except ImportError:
            return float(answer.replace(" ", "") == ref.replace(" ", ""))
        # Graders run in threads: math-verify must not use its signal-based timeout there.
        gold, pred = parse(f"${ref}$", parsing_timeout=None), parse(f"${answer}$", parsing_timeout=None)
        return float(verify(gold, pred, timeout_seconds=None))


@register("json_schema")
class JsonSchemaGrader(Grader):
    """1.0 when the output parses as JSON and validates against ``schema`` (0.5 parse-only credit optional)."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"input", "schema", "partial_credit"})
        import jsonschema

        self.input = self.opt("input", str, OUTPUT)
        schema = self.req("schema", dict)
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise RewardSpecError(self.field("schema"), f"invalid JSON schema: {exc.message}") from None
        self.validator = jsonschema.Draft202012Validator(schema)
        self.partial = float(self.opt("partial_credit", (int, float), 0.0))

    def grade(self, sample, item):
        text = render(self.input, sample, item).strip()
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return 0.0
        return 1.0 if self.validator.is_valid(value) else self.partial


@register("length")
class LengthGrader(Grader):
    """Shaped length score: 1 inside [min, max]; linear decay to 0 over ``tolerance`` outside."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"input", "unit", "min", "max", "tolerance"})
        self.input = self.opt("input", str, OUTPUT)
        self.unit = self.opt("unit", str, "chars")
        if self.unit not in ("chars", "tokens", "words"):
            raise RewardSpecError(self.field("unit"), "must be chars, tokens or words")
        self.lo = self.opt("min", (int, float), 0)
        self.hi = self.opt("max", (int, float), None)
        if self.hi is None and "min" not in spec:
            raise RewardSpecError(self.field("max"), "give min, max or both")
        if self.hi is not None and self.hi < self.lo:
            raise RewardSpecError(self.field("max"), "must be >= min")
        self.tol = float(self.opt("tolerance", (int, float), max(1.0, (self.hi or self.lo or 1) * 0.5)))

    def grade(self, sample, item):
        if self.unit == "tokens":
            n = float(sample.get("output_tokens", 0))
        else:
            text = render(self.input, sample, item)
            n = float(len(text) if self.unit == "chars" else len(text.split()))
        gap = self.lo - n if n < self.lo else (n - self.hi if self.hi is not None and n > self.hi else 0.0)
        return max(0.0, 1.0 - gap / self.tol) if gap > 0 else 1.0


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def bleu(cand: str, ref: str, max_n: int = 4) -> float:
    """Sentence BLEU over whitespace tokens, add-one smoothing for n > 1."""
    c, r = cand.split(), ref.split()
    if not c or not r:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        cn, rn = _ngrams(c, n), _ngrams(r, n)
        overlap = sum(min(v, rn[k]) for k, v in cn.items())
        if n == 1 and overlap == 0:
            return 0.0
        smooth = 1 if n > 1 else 0
        log_p += math.log((overlap + smooth) / (sum(cn.values()) + smooth))
    brevity = 1.0 if len(c) > len(r) else math.exp(1 - len(r) / len(c))
    return brevity * math.exp(log_p / max_n)


def rouge_l(cand: str, ref: str) -> float:
    """ROUGE-L F1 over whitespace tokens (longest common subsequence)."""
    c, r = cand.split(), ref.split()
    if not c or not r:
        return 0.0
    prev = [0] * (len(r) + 1)
    for x in c:
        cur = [0]
        for j, y in enumerate(r):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if not lcs:
        return 0.0
    p, rc = lcs / len(c), lcs / len(r)
    return 2 * p * rc / (p + rc)


SIMILARITY = {
    "fuzzy_match": lambda a, b: difflib.SequenceMatcher(None, a, b).ratio(),
    "exact": lambda a, b: float(a.strip() == b.strip()),
    "bleu": bleu,
    "rouge_l": rouge_l,
}


@register("text_similarity")
class TextSimilarity(Grader):
    """Similarity of input and reference (``evaluation_metric``: fuzzy_match, exact, bleu, rouge_l)."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"input", "reference", "evaluation_metric", "pass_threshold"})
        self.input = self.opt("input", str, OUTPUT)
        self.reference = self.req("reference", str)
        self.metric = self.opt("evaluation_metric", str, "fuzzy_match")
        if self.metric not in SIMILARITY:
            raise RewardSpecError(self.field("evaluation_metric"), f"must be one of {', '.join(SIMILARITY)}")
        self.threshold = self.opt("pass_threshold", (int, float), None)

    def grade(self, sample, item):
        score = SIMILARITY[self.metric](render(self.input, sample, item), render(self.reference, sample, item))
        return float(score >= self.threshold) if self.threshold is not None else float(score)
