"""Local graders, templates, spec errors naming the field, multi formulas, error handling, import cost."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gspo_core.rewards import GRADERS, RewardSpecError, build_reward


def sample(text: str, tokens: int | None = None) -> dict:
    return {"output_text": text, "output_tokens": tokens if tokens is not None else len(text), "finish_reason": "stop"}


def score(spec, text, item=None, tokens=None):
    fn = build_reward(spec)
    try:
        return fn.score_batch([item or {}], [sample(text, tokens)])[0]
    finally:
        fn.close()


def test_every_grader_type_is_registered():
    assert set(GRADERS) == {
        "string_check",
        "regex",
        "math_answer",
        "json_schema",
        "length",
        "text_similarity",
        "python",
        "http",
        "score_model",
        "reward_model",
        "multi",
        "reasoning_gym",
        "openenv",
        "verifiers",
    }


@pytest.mark.parametrize(
    "op,text,ref,expected",
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "paris", "Paris", 0.0),
        ("ne", "a", "b", 1.0),
        ("ne", "a", "a", 0.0),
        ("like", "it is Paris.", "Paris", 1.0),
        ("like", "it is paris.", "Paris", 0.0),
        ("ilike", "it is PARIS.", "paris", 1.0),
        ("ilike", "x", "Paris", 0.0),
    ],
)
def test_string_check(op, text, ref, expected):
    spec = {
        "type": "string_check",
        "name": "s",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": op,
    }
    assert score(spec, text, {"answer": ref}).reward == expected


def test_regex_modes_scores_flags_and_templated_pattern():
    assert score({"type": "regex", "pattern": r"\d+"}, "ab 123").reward == 1.0
    assert score({"type": "regex", "pattern": r"\d+", "mode": "match"}, "ab 123").reward == 0.0
    assert score({"type": "regex", "pattern": r"\d+", "mode": "fullmatch"}, "123").reward == 1.0
    assert score({"type": "regex", "pattern": r"^\d+$", "score_match": 2, "score_no_match": -1}, "12a").reward == -1.0
    assert score({"type": "regex", "pattern": "^{{item.x}}", "flags": "i"}, "Abc", {"x": "a"}).reward == 1.0


def test_regex_catastrophic_backtracking_times_out():
    t0 = time.perf_counter()
    r = score({"type": "regex", "name": "re", "pattern": r"(x+x+)+y", "timeout_s": 0.2}, "x" * 5000)
    assert time.perf_counter() - t0 < 10
    assert r.reward == 0.0 and r.errors["re"].startswith("timeout")


def test_math_answer():
    math = {"type": "math_answer", "reference": "{{item.answer}}"}
    assert score(math, "so the answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"}).reward == 1.0
    assert score(math, "\\boxed{\\frac{1}{\\sqrt{4}}}", {"answer": "1/2"}).reward == 1.0
    assert score(math, "we get 1,234 apples", {"answer": "1234"}).reward == 1.0
    assert score(math, "\\boxed{x^2+2x}", {"answer": "x(x+2)"}).reward == 1.0
    assert score(math, "first 42 then 41", {"answer": "42"}).reward == 0.0  # the last number counts
    assert score(math, "no number here", {"answer": "42"}).reward == 0.0
    assert score({**math, "tolerance": 0.01}, "3.14", {"answer": "3.1416"}).reward == 1.0
    assert score(math, "so x = \u22125", {"answer": "-5"}).reward == 1.0  # a Unicode minus is a minus
    assert score(math, "so x = \u22125", {"answer": "5"}).reward == 0.0
    assert score(math, "x = -5", {"answer": "\u22125"}).reward == 1.0
    deep = "\\boxed{\\sqrt{\\frac{1}{x^{2}}}}"  # three brace levels inside the box
    assert score(math, deep, {"answer": "2"}).reward == 0.0
    assert score(math, deep, {"answer": "\\sqrt{\\frac{1}{x^{2}}}"}).reward == 1.0
    assert score(math, "\\boxed{1} then \\boxed{\\frac{3}{4}} and \\boxed{unclosed", {"answer": "0.75"}).reward == 1.0


def test_json_schema():
    schema = {
        "type": "json_schema",
        "schema": {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}},
    }
    assert score(schema, '{"a": 1}').reward == 1.0
    assert score(schema, '```json\n{"a": 2}\n```').reward == 1.0
    assert score(schema, '{"a": "x"}').reward == 0.0 and score(schema, "not json").reward == 0.0
    assert score({**schema, "partial_credit": 0.25}, '{"b": 1}').reward == 0.25


def test_length_shapes():
    rng = {"type": "length", "min": 2, "max": 4, "tolerance": 2}
    assert score(rng, "abc").reward == 1.0 and score(rng, "abcde").reward == 0.5 and score(rng, "a" * 9).reward == 0
    assert score(rng, "a").reward == 0.5
    target = {"type": "length", "unit": "tokens", "target": 10, "tolerance": 5}
    assert score(target, "x", tokens=10).reward == 1.0 and score(target, "x", tokens=13).reward == pytest.approx(0.4)
    words = {"type": "length", "unit": "words", "max": 3, "tolerance": 1}
    assert score(words, "a b c").reward == 1.0 and score(words, "a b c d").reward == 0.0


def test_text_similarity_metrics():
    def sim(metric, text, ref):
        return score({"type": "text_similarity", "reference": ref, "evaluation_metric": metric}, text).reward

    assert sim("rouge_l", "the cat sat", "the cat sat") == pytest.approx(1.0)
    assert sim("rouge_l", "the dog sat", "the cat sat") == pytest.approx(2 / 3)
    assert sim("rouge_1", "the dog sat", "the cat sat") == pytest.approx(2 / 3)
    assert sim("rouge_2", "the dog sat", "the cat sat") == 0.0
    assert sim("bleu", "a b c d e", "a b c d e") == pytest.approx(1.0) and sim("bleu", "x y z", "a b c") == 0.0
    assert 0 < sim("gleu", "a b c x", "a b c d") < 1
    assert sim("fuzzy_match", "kitten", "sitting") == pytest.approx(8 / 13)
    assert sim("exact", " yes ", "yes") == 1.0
    passed = {"type": "text_similarity", "reference": "abc", "pass_threshold": 0.5}
    assert score(passed, "abd").reward == 1.0 and score(passed, "xyz").reward == 0.0


def test_templates_nested_fields_lists_and_json():
    spec = {
        "type": "string_check",
        "input": "{{item.meta.tags[1]}}|{{item.obj}}",
        "reference": 'b|{"k": 1}',
        "operation": "eq",
    }
    fn = build_reward(spec)
    assert fn.item_fields() == {"meta", "obj"}
    assert fn.score_batch([{"meta": {"tags": ["a", "b"]}, "obj": {"k": 1}}], [sample("")])[0].reward == 1.0
    fn.close()


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ('{"answer": "b", "n": [1, 2]}', {"answer": "b", "n": [1, 2]}),
        (" [1, 2]\n", [1, 2]),
        ("b", None),  # not an object or array
        ('{"answer": ', None),  # cut off
        ('{"x": NaN}', None),  # not JSON
        ("[" * 65 + "]" * 65, None),  # deeper than MAX_OUTPUT_JSON_DEPTH: refused before the parser recurses
        ("[" * 64 + "]" * 64, json.loads("[" * 64 + "]" * 64)),  # as deep as allowed
    ],
)
def test_output_json_is_the_answer_parsed_and_graders_read_it(text, parsed):
    """OpenAI's ``sample.output_json``: what the step and the dry runs give graders beside ``output_text``."""
    from gspo_core.rewards import output_json

    assert output_json(text) == parsed
    spec = {"type": "string_check", "input": "{{sample.output_json.answer}}", "reference": "b", "operation": "eq"}
    fn = build_reward(spec)
    try:
        got = fn.score_batch([{}], [{**sample(text), "output_json": output_json(text)}])[0]
    finally:
        fn.close()
    answered = isinstance(parsed, dict) and "answer" in parsed
    assert got.reward == float(answered) and bool(got.errors) != answered, got


def test_item_fields_include_defaults_and_every_sub_grader():
    spec = {
        "type": "multi",
        "graders": {
            "a": {"type": "string_check", "reference": "{{ item.answer }}", "operation": "eq"},
            "b": {
                "type": "score_model",
                "base_url": "http://judge.invalid/v1",
                "model": "m",
                "input": [{"role": "user", "content": "{{item.rubric.text}} {{sample.output_text}}"}],
            },
            "c": {"type": "regex", "pattern": "x", "input": "{{item.other}}"},
        },
    }
    fn = build_reward(spec)
    assert fn.item_fields() == {"answer", "rubric", "other"} and fn.grader_names == ["a", "b", "c"]
    fn.close()


def test_multi_formula():
    spec = {
        "type": "multi",
        "graders": {
            "correct": {"type": "string_check", "reference": "{{item.answer}}", "operation": "eq"},
            "fmt": {"type": "regex", "pattern": "^[a-z]+$"},
        },
        "calculate_output": "0.8*correct + 0.2*fmt",
    }
    fn = build_reward(spec)
    r = fn.score_batch([{"answer": "abc"}] * 3, [sample("abc"), sample("ABC"), sample("abd")])
    assert [x.reward for x in r] == pytest.approx([1.0, 0.0, 0.2])
    assert r[0].scores == {"correct": 1.0, "fmt": 1.0}
    fn.close()
    funcs = {**spec, "calculate_output": "max(correct, fmt) - abs(-0.5) * min(correct, (fmt + 1) / 2)"}
    assert score(funcs, "abd", {"answer": "abc"}).reward == pytest.approx(1 - 0.5 * 0)
    mean = {"type": "multi", "graders": spec["graders"]}
    assert score(mean, "abd", {"answer": "abc"}).reward == pytest.approx(0.5)
    div0 = {**spec, "calculate_output": "correct / fmt"}
    r = score(div0, "ABC", {"answer": "x"})
    assert r.reward == 0.0 and r.errors["calculate_output"].startswith("invalid_output")


def test_nested_multi():
    inner = {
        "type": "multi",
        "graders": {"x": {"type": "regex", "pattern": "a"}, "y": {"type": "regex", "pattern": "b"}},
        "calculate_output": "x * y",
    }
    spec = {
        "type": "multi",
        "graders": {"both": inner, "c": {"type": "regex", "pattern": "c"}},
        "calculate_output": "both + c",
    }
    assert score(spec, "abc").reward == 2.0 and score(spec, "ac").reward == 1.0


@pytest.mark.parametrize(
    "spec,field",
    [
        ("not a dict", "reward"),
        ({"type": "nope"}, "type"),
        ({"type": "string_check", "reference": "x", "operation": "zz"}, "operation"),
        ({"type": "string_check", "operation": "eq"}, "reference"),
        ({"type": "string_check", "reference": 3, "operation": "eq"}, "reference"),
        ({"type": "string_check", "reference": "{{sample.nope}}", "operation": "eq"}, "reference"),
        ({"type": "string_check", "name": 5, "reference": "x", "operation": "eq"}, "name"),
        ({"type": "regex", "pattern": "("}, "pattern"),
        ({"type": "regex", "pattern": "a", "mode": "find"}, "mode"),
        ({"type": "regex", "pattern": "a", "flags": "q"}, "flags"),
        ({"type": "regex", "pattern": "a", "score_match": "1"}, "score_match"),
        ({"type": "regex", "pattern": "a", "bogus": 1}, "bogus"),
        ({"type": "math_answer"}, "reference"),
        ({"type": "math_answer", "reference": "1", "tolerance": -1}, "tolerance"),
        ({"type": "json_schema", "schema": {"type": 5}}, "schema"),
        ({"type": "json_schema"}, "schema"),
        ({"type": "length"}, "target"),
        ({"type": "length", "min": 5, "max": 2}, "max"),
        ({"type": "length", "max": 5, "unit": "bytes"}, "unit"),
        ({"type": "length", "target": 5, "max": 8}, "target"),
        ({"type": "text_similarity", "reference": "x", "evaluation_metric": "meteor"}, "evaluation_metric"),
        ({"type": "text_similarity", "reference": "x", "pass_threshold": 2}, "pass_threshold"),
        ({"type": "multi", "graders": {}}, "graders"),
        ({"type": "multi", "graders": {"a": {"type": "regex"}}}, "graders.a.pattern"),
        (
            {"type": "multi", "graders": {"a": {"type": "multi", "graders": {"b": {"type": "x"}}}}},
            "graders.a.graders.b.type",
        ),
        ({"type": "multi", "graders": {"a b": {"type": "regex", "pattern": "a"}}}, "graders.a b"),
        (
            {"type": "multi", "graders": {"a": {"type": "regex", "pattern": "a"}}, "calculate_output": "a + b"},
            "calculate_output",
        ),
        (
            {
                "type": "multi",
                "graders": {"a": {"type": "regex", "pattern": "a"}},
                "calculate_output": "__import__('os')",
            },
            "calculate_output",
        ),
        (
            {"type": "multi", "graders": {"a": {"type": "regex", "pattern": "a"}}, "calculate_output": "a.__class__"},
            "calculate_output",
        ),
        (
            {"type": "multi", "graders": {"a": {"type": "regex", "pattern": "a"}}, "calculate_output": "a +"},
            "calculate_output",
        ),
        ({"type": "python", "source": "def grade(:"}, "source"),
        ({"type": "python", "source": "x = 1"}, "source"),
        ({"type": "python", "source": "def grade(s, i): return 1", "timeout_s": 0}, "timeout_s"),
        ({"type": "python", "source": "def grade(s, i): return 1", "memory_mb": 1.5}, "memory_mb"),
        ({"type": "http", "url": "ftp://x"}, "url"),
        ({"type": "http", "url": "http://x", "retries": 99}, "retries"),
        ({"type": "http", "url": "http://x", "headers": {"a": 1}}, "headers.a"),
        ({"type": "score_model", "base_url": "http://x", "model": "m", "input": [{"role": 1}]}, "input[0]"),
        ({"type": "score_model", "base_url": "http://x", "model": "m", "input": []}, "input"),
        ({"type": "score_model", "base_url": "http://x", "input": [{"role": "user", "content": "x"}]}, "model"),
        (
            {
                "type": "score_model",
                "base_url": "http://x",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "range": [5, 1],
            },
            "range",
        ),
        (
            {
                "type": "score_model",
                "base_url": "http://x",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "sampling_params": {"logit_bias": {}},
            },
            "sampling_params.logit_bias",
        ),
        ({"type": "reward_model"}, "model"),
        ({"type": "reward_model", "model": "/m", "activation": "tanh"}, "activation"),
    ],
)
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(RewardSpecError) as exc:
        build_reward(spec)
    assert exc.value.field == field and exc.value.message
    assert isinstance(exc.value, ValueError)


def test_grader_errors_score_zero_and_are_recorded():
    spec = {
        "type": "multi",
        "graders": {
            "ok": {"type": "regex", "pattern": "a"},
            "missing": {"type": "string_check", "reference": "{{item.nope}}", "operation": "eq"},
            "badpat": {"type": "regex", "pattern": "{{item.p}}"},
        },
    }
    r = score(spec, "a", {"p": "("})
    assert r.scores == {"ok": 1.0, "missing": 0.0, "badpat": 0.0}
    assert r.errors["missing"].startswith("missing_field") and "item.nope" in r.errors["missing"]
    assert r.errors["badpat"].startswith("exception") and "ok" not in r.errors
    assert r.reward == pytest.approx(1 / 3)


def test_importing_rewards_is_cheap():
    code = (
        "import sys, gspo_core.rewards\n"
        "heavy = [m for m in ('torch', 'transformers', 'httpx', 'jsonschema', 'math_verify', 'sympy') "
        "if m in sys.modules]\nprint(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def _junk():
    from hypothesis import strategies as st

    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-10, 10**12),
        st.floats(allow_nan=True),
        st.text(max_size=20),
        st.sampled_from(["{{item.a}}", "{{sample.x}}", "(", "\x00", "a+b"]),
    )
    return st.recursive(
        scalar,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=8,
    )


def test_junk_specs_only_ever_raise_reward_spec_errors():
    """What the API passes straight from a request body: anything but a RewardSpecError is a 500."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    keys = [
        "input",
        "reference",
        "operation",
        "pattern",
        "mode",
        "flags",
        "schema",
        "min",
        "max",
        "target",
        "unit",
        "evaluation_metric",
        "source",
        "url",
        "graders",
        "calculate_output",
        "range",
        "model",
        "timeout_s",
        "retries",
        "headers",
        "sampling_params",
        "tolerance",
        "name",
        "memory_mb",
        "activation",
    ]

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(GRADERS)), st.dictionaries(st.sampled_from(keys), _junk(), max_size=5))
    def check(kind, fields):
        try:
            build_reward({"type": kind, **fields}).close()
        except RewardSpecError as exc:
            assert isinstance(exc.field, str) and exc.field

    check()


def _nested_multi(depth: int) -> dict:
    spec: dict = {"type": "length", "target": 1}
    for _ in range(depth):
        spec = {"type": "multi", "graders": {"g": spec}}
    return spec


def _deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "spec,field",
    [
        (_nested_multi(9), "graders.g.graders.g.graders.g.graders.g.graders.g.graders.g.graders.g.graders.g.graders"),
        (_nested_multi(500), None),  # refused by the spec's depth bound before any recursion
        ({"type": "multi", "graders": {f"g{i}": {"type": "length", "target": 1} for i in range(65)}}, "graders"),
        (
            {
                "type": "multi",
                "graders": {"a": {"type": "length", "target": 1}},
                "calculate_output": "+".join(["a"] * 600),
            },
            "calculate_output",
        ),
        (
            {"type": "multi", "graders": {"a": {"type": "length", "target": 1}}, "calculate_output": "-" * 1900 + "a"},
            "calculate_output",
        ),
        (
            {
                "type": "multi",
                "graders": {"a": {"type": "length", "target": 1}},
                "calculate_output": "abs(" * 120 + "a" + ")" * 120,
            },
            "calculate_output",
        ),
        ({"type": "json_schema", "schema": _deep(20)}, "schema"),
        ({"type": "python", "source": "def grade(s, i):\n    return " + "-" * 50000 + "1\n"}, "source"),
        (
            {"type": "python", "source": "x = " + "+".join(["a"] * 30000) + "\ndef grade(s, i):\n    return 1\n"},
            "source",
        ),
        ({"type": "length", "target": float("nan")}, "target"),
        (
            {"type": "multi", "graders": {"a": {"type": "math_answer", "reference": "1", "tolerance": float("inf")}}},
            "graders.a.tolerance",
        ),
        ({"type": "json_schema", "schema": {"type": "number", "maximum": float("-inf")}}, "schema.maximum"),
        (
            {
                "type": "score_model",
                "base_url": "https://j.example/v1",
                "model": "m",
                "range": [0, float("nan")],
                "input": [{"role": "user", "content": "x"}],
            },
            "range[1]",
        ),
        ({"type": "length", "target": True}, "target"),
        ({"type": "regex", "pattern": "a", "score_match": False}, "score_match"),
        (
            {
                "type": "score_model",
                "base_url": "https://j.example/v1",
                "model": "m",
                "range": [False, 1],
                "input": [{"role": "user", "content": "x"}],
            },
            "range",
        ),
        (
            {
                "type": "score_model",
                "base_url": "https://j.example/v1",
                "model": "m",
                "sampling_params": {"max_tokens": True},
                "input": [{"role": "user", "content": "x"}],
            },
            "sampling_params.max_tokens",
        ),
        ({"type": "python", "source": "def grade(s, i):\n    return 1\n", "memory_mb": True}, "memory_mb"),
    ],
)
def test_oversized_deep_and_non_finite_specs_name_the_field(spec, field):
    with pytest.raises(RewardSpecError) as exc:
        build_reward(spec)
    if field is None:
        assert exc.value.field.startswith("graders.g.") and "nested deeper" in exc.value.message
    else:
        assert exc.value.field == field, exc.value


def test_spec_bounds_leave_room_for_real_specs():
    ok = {
        "type": "multi",
        "graders": {f"g{i}": {"type": "length", "target": 1} for i in range(64)},
        "calculate_output": " + ".join(f"g{i}" for i in range(64)),
    }
    build_reward(ok).close()
    build_reward(_nested_multi(8)).close()
    build_reward({"type": "json_schema", "schema": _deep(12)}).close()


def test_map_reward_models_stops_at_the_deepest_nesting_a_spec_may_have():
    from gspo_core.rewards import map_reward_models

    deep = _nested_multi(5000)  # far deeper than the interpreter's recursion limit
    assert map_reward_models(deep, str.upper) is not None
