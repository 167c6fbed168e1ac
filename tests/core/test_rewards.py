"""Graders for real: local graders, spec errors naming the field, http / judge servers, reward model."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gspo_core.rewards import RewardSpecError, build_reward


def sample(text: str, tokens: int | None = None) -> dict:
    return {"output_text": text, "output_tokens": tokens if tokens is not None else len(text), "finish_reason": "stop"}


def score(spec, text, item=None):
    fn = build_reward(spec)
    try:
        return fn.score_batch([item or {}], [sample(text)])[0]
    finally:
        fn.close()


@pytest.mark.parametrize("op,text,ref,expected", [
    ("eq", "Paris", "Paris", 1.0), ("eq", "paris", "Paris", 0.0), ("ne", "a", "b", 1.0),
    ("like", "it is Paris.", "Paris", 1.0), ("ilike", "it is PARIS.", "paris", 1.0), ("like", "x", "Paris", 0.0),
])
def test_string_check(op, text, ref, expected):
    spec = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": op}
    assert score(spec, text, {"answer": ref}).reward == expected


def test_regex_math_json_length_similarity():
    assert score({"type": "regex", "pattern": r"^\d+$"}, "123").reward == 1.0
    assert score({"type": "regex", "pattern": r"^\d+$", "score_no_match": -1}, "12a").reward == -1.0
    assert score({"type": "regex", "pattern": "^{{item.x}}", "flags": "i"}, "Abc", {"x": "a"}).reward == 1.0
    math = {"type": "math_answer", "reference": "{{item.answer}}"}
    assert score(math, "so the answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"}).reward == 1.0
    assert score(math, "we get 1,234 apples", {"answer": "1234"}).reward == 1.0
    assert score(math, "\\boxed{x^2+2x}", {"answer": "x(x+2)"}).reward == 1.0
    assert score(math, "41", {"answer": "42"}).reward == 0.0
    schema = {"type": "json_schema", "schema": {"type": "object", "required": ["a"]}}
    assert score(schema, '{"a": 1}').reward == 1.0 and score(schema, '{"b": 1}').reward == 0.0
    assert score(schema, "not json").reward == 0.0
    length = {"type": "length", "min": 2, "max": 4, "tolerance": 2}
    assert score(length, "abc").reward == 1.0 and score(length, "abcde").reward == 0.5
    sim = {"type": "text_similarity", "reference": "the cat sat", "evaluation_metric": "rouge_l"}
    assert score(sim, "the cat sat").reward == pytest.approx(1.0)
    assert 0 < score(sim, "the dog sat").reward < 1
    bleu = {"type": "text_similarity", "reference": "a b c d e", "evaluation_metric": "bleu"}
    assert score(bleu, "a b c d e").reward == pytest.approx(1.0) and score(bleu, "x y z").reward == 0.0


def test_multi_formula_and_item_fields():
    spec = {"type": "multi", "graders": {
        "correct": {"type": "string_check", "reference": "{{item.answer}}", "operation": "eq"},
        "fmt": {"type": "regex", "pattern": "^[a-z]+$"}}, "calculate_output": "0.8*correct + 0.2*fmt"}
    fn = build_reward(spec)
    assert fn.item_fields() == {"answer"} and fn.grader_names == ["correct", "fmt"]
    r = fn.score_batch([{"answer": "abc"}, {"answer": "abc"}], [sample("abc"), sample("ABC")])
    assert r[0].reward == pytest.approx(1.0) and r[1].reward == pytest.approx(0.0)
    assert r[0].scores == {"correct": 1.0, "fmt": 1.0}
    fn.close()


@pytest.mark.parametrize("spec,field", [
    ({"type": "nope"}, "type"),
    ({"type": "string_check", "reference": "x", "operation": "zz"}, "operation"),
    ({"type": "string_check", "operation": "eq"}, "reference"),
    ({"type": "regex", "pattern": "("}, "pattern"),
    ({"type": "regex", "pattern": "a", "bogus": 1}, "bogus"),
    ({"type": "multi", "graders": {"a": {"type": "regex"}}}, "graders.a.pattern"),
    ({"type": "multi", "graders": {"a": {"type": "regex", "pattern": "a"}}, "calculate_output": "a + b"},
     "calculate_output"),
    ({"type": "multi", "graders": {"a": {"type": "regex", "pattern": "a"}}, "calculate_output": "__import__('os')"},
     "calculate_output"),
    ({"type": "python", "source": "def grade(:"}, "source"),
    ({"type": "http", "url": "ftp://x"}, "url"),
    ({"type": "json_schema", "schema": {"type": 5}}, "schema"),
    ({"type": "score_model", "base_url": "http://x", "model": "m", "input": [{"role": 1}]}, "input[0]"),
])
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(RewardSpecError) as exc:
        build_reward(spec)
    assert exc.value.field == field


def test_grader_errors_score_zero_and_are_counted():
    spec = {"type": "multi", "graders": {
        "ok": {"type": "regex", "pattern": "a"},
        "missing": {"type": "string_check", "reference": "{{item.nope}}", "operation": "eq"}}}
    r = score(spec, "a", {})
    assert r.scores["missing"] == 0.0 and r.errors["missing"].startswith("missing_field")
    assert r.reward == pytest.approx(0.5)


class _Handler(BaseHTTPRequestHandler):
    calls: list = []
    fail_first = 0
    delay = 0.0

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((self.path, body))
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(500)
            self.end_headers()
            return
        time.sleep(type(self).delay)
        if self.path.endswith("/chat/completions"):
            text = body["messages"][-1]["content"]
            reply = {"choices": [{"message": {"role": "assistant", "content": f"Score: {8 if 'good' in text else 2}"}}]}
        else:
            reply = {"reward": len(body["sample"]["output_text"]) / 10}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    _Handler.calls, _Handler.fail_first, _Handler.delay = [], 0, 0.0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_http_grader_retries_and_times_out(server):
    _Handler.fail_first = 1
    r = score({"type": "http", "url": server + "/score", "retries": 2}, "abcd", {"q": 1})
    assert r.reward == pytest.approx(0.4) and not r.errors
    assert len(_Handler.calls) == 2 and _Handler.calls[-1][1]["item"] == {"q": 1}
    _Handler.delay = 1.0
    r = score({"type": "http", "url": server + "/score", "timeout_s": 0.2, "retries": 0}, "abcd")
    assert r.reward == 0.0 and r.errors["http"].startswith("timeout")


def test_score_model_judge(server):
    spec = {"type": "score_model", "base_url": server + "/v1", "model": "judge", "range": [0, 10],
            "input": [{"role": "system", "content": "Rate 0-10."},
                      {"role": "user", "content": "Answer: {{sample.output_text}}"}]}
    assert score(spec, "a good answer").reward == pytest.approx(0.8)
    assert score(spec, "meh").reward == pytest.approx(0.2)


def test_graders_of_a_batch_run_concurrently(server):
    _Handler.delay = 0.5
    spec = {"type": "multi", "graders": {f"g{i}": {"type": "http", "url": server + "/s", "retries": 0} for i in range(4)}}
    fn = build_reward(spec)
    t0 = time.perf_counter()
    fn.score_batch([{}], [sample("ab")])
    elapsed = time.perf_counter() - t0
    fn.close()
    assert elapsed < 1.5, f"4 graders of 0.5 s took {elapsed:.2f} s: not concurrent"


def test_reward_model_grader(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from gspo_core.toy import build_tokenizer

    tok = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    fn = build_reward({"type": "reward_model", "model": str(tmp_path), "input": "{{sample.output_text}}"})
    res = fn.score_batch([{}, {}, {}], [sample("hello"), sample("a different text"), sample("hello")])
    fn.close()
    assert all(0 < r.reward < 1 and not r.errors for r in res)
    assert res[0].reward == pytest.approx(res[2].reward) and res[0].reward != res[1].reward
