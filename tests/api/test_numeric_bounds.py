"""Every numeric field of every request body the app's OpenAPI schema declares, and every number a grader spec
reads, given a huge, non-finite, negative or over-long value: a 4xx naming the field, never a 500.

The fields are enumerated from the live app's schema (and, for graders, from the numbers each grader reads while
it builds), so a field added later is fuzzed too; the schema must declare a bound on each.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.schemas import EXAMPLE_REWARD
from gspo_core.environments import ReasoningGymEnvironment
from gspo_core.rewards import GRADERS
from gspo_core.rewards.base import Grader
from tests.api.test_schemathesis import APP, seed_tenant

#: Raw JSON for a number, spelled as a client could send it. Each is out of every field's bounds.
HUGE = {
    "1e308": "1e308",
    "-1e308": "-1e308",
    "1e400": "1e400",
    "400 digits": "1" * 400,
    "-400 digits": "-" + "1" * 400,
    "5000 digits": "9" * 5000,
    "NaN": "NaN",
    "Infinity": "Infinity",
    "-Infinity": "-Infinity",
    '"nan"': '"nan"',
    '"inf"': '"inf"',
}
_MARK = "__fuzzed_number__"


@pytest.fixture(scope="module")
def client():
    """The seeded app within its lifespan (its grading threads started), 500s answered, not raised."""
    with TestClient(APP, raise_server_exceptions=False) as started:
        yield started


@pytest.fixture(scope="module")
def fuzzer() -> dict:
    """This module's own tenant, file and job in the shared app (test_schemathesis.py's fuzzer deletes its own)."""
    return seed_tenant(APP, "bounds")


def _resolve(schema: dict, components: dict) -> dict:
    while "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def numeric_fields(
    schema: dict, components: dict, path: tuple = (), examples: tuple = (), depth: int = 0
) -> Iterator[tuple[tuple, dict, tuple]]:
    """``(path, schema, examples)`` of each number under ``schema``; ``examples``: ``(path, example)`` of the
    branches (a tool kind) the path goes through, to be put in place first."""
    schema = _resolve(schema, components)
    if depth > 12:
        return
    if path and isinstance(schema.get("examples"), list) and isinstance(schema["examples"][0], dict):
        examples += ((path, schema["examples"][0]),)
    if schema.get("type") in ("integer", "number"):
        yield path, schema, examples
    for key in ("anyOf", "oneOf", "allOf"):
        branches = [_resolve(branch, components) for branch in schema.get(key, [])]
        # A position that takes a string too (Tinker's stop: strings or token ids) takes "nan" as a string.
        strings = any(branch.get("type") == "string" for branch in branches)
        for branch in branches:
            branch = {**branch, "x-string-too": True} if strings and branch.get("type") != "string" else branch
            yield from numeric_fields(branch, components, path, examples, depth + 1)
    for name, sub in schema.get("properties", {}).items():
        yield from numeric_fields(sub, components, (*path, name), examples, depth + 1)
    if isinstance(schema.get("items"), dict):
        yield from numeric_fields(schema["items"], components, (*path, 0), examples, depth + 1)


def _put(body: Any, path: tuple, value: Any) -> None:
    """Set ``path`` in ``body``, making what is missing; a tagged object (``{"type": k, k: {...}}``, OpenAI's
    method) is switched to the key the path takes."""
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if isinstance(key, int):
            while len(body) <= key:
                body.append({})
            if last:
                body[key] = value
            body = body[key]
            continue
        tag = body.get("type")
        if isinstance(tag, str) and tag in body and key != tag and key != "type":
            del body[tag]
            body["type"] = key
        if last:
            body[key] = value
        else:
            body.setdefault(key, [] if isinstance(path[i + 1], int) else {})
            body = body[key]


def _label(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _cases() -> list[tuple[str, str, tuple, tuple, dict]]:
    spec = APP.openapi()
    components = spec["components"]["schemas"]
    cases = []
    for route, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is None:
                continue
            seen = set()
            for path, schema, examples in numeric_fields(body, components):
                if path not in seen:
                    seen.add(path)
                    cases.append((method.upper(), route, path, examples, schema))
    return cases


CASES = _cases()


def test_the_schema_bounds_every_numeric_field():
    """Every number a request may carry has both bounds in the schema (and so in OpenAPI's documentation)."""
    assert len(CASES) > 100  # GSPOConfig's fields (native, and under both OpenAI methods), tools, seeds, ...
    unbounded = [
        f"{route} {_label(path)}"
        for _, route, path, _, schema in CASES
        if not {"minimum", "exclusiveMinimum"} & schema.keys() or not {"maximum", "exclusiveMaximum"} & schema.keys()
    ]
    assert not unbounded


def _body(method: str, route: str, path: tuple, examples: tuple, file_id: str) -> dict:
    components = APP.openapi()["components"]["schemas"]
    schema = APP.openapi()["paths"][route][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
    base = _resolve(schema, components).get("examples")
    assert base, f"{method} {route}: its body schema needs an example to fuzz from"
    body = copy.deepcopy(base[0])
    if "training_file" in body:
        body["training_file"] = file_id
    if path[0] == "environment":  # an environment job names no files
        body.pop("training_file", None)
        body.pop("validation_file", None)
        openenv = path[1] not in ReasoningGymEnvironment.model_fields  # a field of the openenv type alone
        body["environment"] = (
            {"type": "openenv", "url": "https://env.example.com"}
            if openenv
            else {"type": "reasoning_gym", "tasks": [{"name": "chain_sum"}]}
        )
    for where, example in examples:
        _put(body, where, copy.deepcopy(example))
    _put(body, path, _MARK)
    return body


def _error_field(response) -> str | None:
    error = response.json()["error"]
    return error.get("param") if "param" in error else error.get("field")


@pytest.mark.parametrize(
    ("method", "route", "path", "examples", "schema"),
    CASES,
    ids=[f"{m} {r} {_label(p)}" for m, r, p, _, _ in CASES],
)
def test_an_out_of_range_number_is_a_4xx_naming_its_field(client, fuzzer, method, route, path, examples, schema):
    body = json.dumps(_body(method, route, path, examples, fuzzer["ids"]["file_id"]))
    limit = schema.get("maximum", schema.get("exclusiveMaximum"))
    values = {**HUGE, "over the maximum": repr(limit * 2 + 1)}
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    values["under the minimum"] = repr(low - 1)
    if schema.get("x-string-too"):
        del values['"nan"'], values['"inf"']
    headers = {"Authorization": f"Bearer {fuzzer['key']}", "Content-Type": "application/json"}
    wrong = {}
    for name, raw in values.items():
        r = client.request(method, route, content=body.replace(json.dumps(_MARK), raw), headers=headers)
        field = _error_field(r) if r.headers.get("content-type", "").startswith("application/json") else None
        if not (400 <= r.status_code < 500 and field is not None and field.startswith(_label(path))):
            wrong[name] = (r.status_code, r.text[:200])
    assert not wrong, f"{_label(path)}: {wrong}"


# --- graders: the numbers each reads (recorded while a valid spec builds) ------------------------------------

#: A valid spec of each grader type, the base whose numbers are fuzzed (reward_model needs a model directory).
GRADER_SPECS: dict[str, dict] = {
    "string_check": EXAMPLE_REWARD,
    "regex": {"type": "regex", "pattern": "a"},
    "math_answer": {"type": "math_answer", "reference": "{{item.answer}}"},
    "json_schema": {"type": "json_schema", "schema": {"type": "object"}},
    "length": {"type": "length", "target": 10},
    "text_similarity": {"type": "text_similarity", "reference": "abc", "evaluation_metric": "fuzzy_match"},
    "python": {"type": "python", "source": "def grade(sample, item):\n    return 1.0\n"},
    "http": {"type": "http", "url": "https://grader.example.com/score"},
    "score_model": {
        "type": "score_model",
        "base_url": "https://judge.example.com/v1",
        "model": "m",
        "input": [{"role": "user", "content": "{{sample.output_text}}"}],
    },
    "reward_model": {"type": "reward_model", "model": "toy"},
    "multi": {"type": "multi", "graders": {"a": EXAMPLE_REWARD}, "calculate_output": "2 * a"},
    "reasoning_gym": {"type": "reasoning_gym"},
    "openenv": {"type": "openenv"},
    "verifiers": {"type": "verifiers", "score": "reward"},
}


def _grader_numbers() -> list[tuple[str, str]]:
    """``(grader type, key)`` of every number a grader reads through ``Grader.num`` while its spec builds."""
    from gspo_core.rewards import build_reward

    read: list[tuple[str, str]] = []
    real = Grader.num

    def recording(self, key, *args, **kwargs):
        read.append((self.spec.get("type"), key))
        return real(self, key, *args, **kwargs)

    Grader.num = recording  # type: ignore[method-assign]
    try:
        for spec in GRADER_SPECS.values():
            with contextlib.suppress(Exception):  # a grader this host cannot build: what it read still counts
                build_reward(spec).close()
    finally:
        Grader.num = real  # type: ignore[method-assign]
    return sorted(set(read))


def test_every_grader_type_has_a_spec_to_fuzz():
    assert set(GRADER_SPECS) == set(GRADERS)


GRADER_NUMBERS = _grader_numbers()
#: Numbers inside structured fields (read as a whole, not through ``num``).
STRUCTURED = [
    ("score_model", ("range", 1), "range"),
    ("score_model", ("sampling_params", "temperature"), "sampling_params.temperature"),
    ("score_model", ("sampling_params", "max_tokens"), "sampling_params.max_tokens"),
    ("multi", ("calculate_output",), "calculate_output"),
]


@pytest.mark.parametrize(
    ("kind", "path", "field"),
    [(kind, (key,), key) for kind, key in GRADER_NUMBERS] + STRUCTURED,
    ids=[f"{kind}.{key}" for kind, key in GRADER_NUMBERS] + [f"{k}.{f}" for k, _, f in STRUCTURED],
)
def test_a_grader_number_out_of_range_is_a_4xx_naming_its_field(client, fuzzer, kind, path, field):
    spec = copy.deepcopy(GRADER_SPECS[kind])
    if path[0] == "range":
        spec["range"] = [0, _MARK]
    elif path[0] == "calculate_output":
        spec["calculate_output"] = f"a * {_MARK}"
    else:
        _put(spec, path, _MARK)
    headers = {"Authorization": f"Bearer {fuzzer['key']}", "Content-Type": "application/json"}
    wrong = {}
    for name, raw in {**HUGE, "-1e16": "-1e16"}.items():
        if path[0] == "calculate_output":  # a formula is text: its numbers are spelled in it
            text = json.dumps({"reward": spec, "samples": ["x"]}).replace(_MARK, raw.strip('"'))
        else:
            text = json.dumps({"reward": spec, "samples": ["x"]}).replace(json.dumps(_MARK), raw)
        r = client.post("/v1/rewards/run", content=text, headers=headers)
        if not (400 <= r.status_code < 500 and _error_field(r).startswith(f"reward.{field}")):
            wrong[name] = (r.status_code, r.text[:200])
    assert len(GRADER_NUMBERS) >= 15 and not wrong, wrong


# --- tool URLs: the egress parser that graders and webhooks use ----------------------------------------------

TOOL_ENTRIES = {
    "http": {"type": "http", "name": "lookup"},
    "mcp": {"type": "mcp"},
    "agent": {"type": "agent"},
}


@pytest.mark.parametrize("host", ["0177.0.0.1", "127.000.000.001", "0x7f.1", "[::ffff:127.0.0.1]", "127.1"])
def test_a_tool_url_the_egress_check_refuses_is_a_4xx_naming_it(client, fuzzer, host):
    """Hosts httpx cannot parse (octal, zero-padded) or that spell loopback: refused as a grader's or a webhook's
    URL is, on every kind of tool and on OpenAI's tools, never a 500."""
    headers = {"Authorization": f"Bearer {fuzzer['key']}"}
    url = f"http://{host}/x"
    file_id = fuzzer["ids"]["file_id"]
    answers = {}
    for kind, entry in TOOL_ENTRIES.items():
        job = {
            "model": "toy",
            "training_file": file_id,
            "reward": EXAMPLE_REWARD,
            "tools": [{**entry, "server_url": url}],
        }
        answers[kind] = client.post("/v1/jobs", json=job, headers=headers)
    method = {
        "type": "reinforcement",
        "reinforcement": {"grader": EXAMPLE_REWARD, "tools": [{"name": "t", "server_url": url}]},
    }
    answers["openai"] = client.post(
        "/v1/fine_tuning/jobs", json={"model": "toy", "training_file": file_id, "method": method}, headers=headers
    )
    answers["webhook"] = client.post("/v1/webhooks", json={"url": url}, headers=headers)
    fields = {kind: (r.status_code, _error_field(r)) for kind, r in answers.items()}
    assert fields == {
        "http": (422, "tools[0].server_url"),
        "mcp": (422, "tools[0].server_url"),
        "agent": (422, "tools[0].server_url"),
        "openai": (400, "method.reinforcement.tools[0].server_url"),
        "webhook": (422, "url"),
    }
