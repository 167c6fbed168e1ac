"""Graders that call out, against real local servers and a real tiny model: http, score_model,
reward_model; and the concurrency of a batch."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from gspo_core.rewards import GraderPolicy, RewardSpecError, build_reward

#: The local test servers listen on loopback, which graders reach only when the operator allows it.
LOCAL = GraderPolicy(egress_allow=("127.0.0.1",))


def sample(text: str) -> dict:
    return {"output_text": text, "output_tokens": len(text), "finish_reason": "stop"}


def score(spec, text, item=None):
    fn = build_reward(spec, LOCAL)
    try:
        return fn.score_batch([item or {}], [sample(text)])[0]
    finally:
        fn.close()


class _Handler(BaseHTTPRequestHandler):
    """A reward endpoint (/score*), an OpenAI-shaped chat-completions judge (/v1/chat/completions)
    and misbehaving routes; failures and delays are set per test."""

    calls: ClassVar[list] = []  # shared by the server's handler instances; reset per test
    fail_first = 0
    delay = 0.0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.calls.append((self.path, body, dict(self.headers)))
        if cls.fail_first > 0:
            cls.fail_first -= 1
            return self._send(500, b"boom")
        time.sleep(cls.delay)
        if self.path == "/v1/chat/completions":
            text = body["messages"][-1]["content"]
            content = "I cannot say" if "refuse" in text else f"Score: {8 if 'good' in text else 2}/10"
            reply = {
                "id": "c1",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
                ],
            }
        elif self.path == "/bad-request":
            return self._send(400, b'{"detail": "nope"}')
        elif self.path == "/not-a-number":
            reply = {"reward": "high"}
        elif self.path == "/plain":
            reply = 0.25
        else:
            reply = {"reward": len(body["sample"]["output_text"]) / 10}
        self._send(200, json.dumps(reply).encode())

    def _send(self, status, data):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    _Handler.calls, _Handler.fail_first, _Handler.delay = [], 0, 0.0
    # The default listen backlog (5) refuses connections when 32 graders call at once on a busy machine.
    srv = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_http_grader_posts_sample_and_item(server):
    r = score({"type": "http", "url": server + "/score", "headers": {"X-Token": "t"}}, "abcd", {"q": 1})
    assert r.reward == pytest.approx(0.4) and not r.errors
    _, body, headers = _Handler.calls[0]
    assert body == {"sample": sample("abcd"), "item": {"q": 1}} and headers["X-Token"] == "t"
    assert score({"type": "http", "url": server + "/plain"}, "x").reward == 0.25


def test_http_grader_retries_after_500_with_backoff(server):
    _Handler.fail_first = 2
    t0 = time.perf_counter()
    r = score({"type": "http", "url": server + "/score", "retries": 2, "backoff_s": 0.2}, "abcd")
    assert r.reward == pytest.approx(0.4) and not r.errors and len(_Handler.calls) == 3
    assert time.perf_counter() - t0 >= 0.2 + 0.4  # backoff 0.2 s then 0.4 s
    _Handler.calls, _Handler.fail_first = [], 5
    r = score({"type": "http", "name": "h", "url": server + "/score", "retries": 1, "backoff_s": 0}, "abcd")
    assert r.reward == 0.0 and r.errors["h"].startswith("http_error") and "500" in r.errors["h"]
    assert len(_Handler.calls) == 2


def test_http_grader_timeout_4xx_bad_output_and_refused(server):
    _Handler.delay = 1.0
    r = score({"type": "http", "name": "h", "url": server + "/score", "timeout_s": 0.2, "retries": 0}, "abcd")
    assert r.reward == 0.0 and r.errors["h"].startswith("timeout")
    _Handler.delay, _Handler.calls = 0.0, []
    r = score({"type": "http", "name": "h", "url": server + "/bad-request", "retries": 3}, "x")
    assert r.errors["h"].startswith("http_error") and "400" in r.errors["h"] and len(_Handler.calls) == 1
    r = score({"type": "http", "name": "h", "url": server + "/not-a-number"}, "x")
    assert r.errors["h"].startswith("invalid_output")
    r = score({"type": "http", "name": "h", "url": "http://127.0.0.1:9/x", "retries": 0}, "x")
    assert r.reward == 0.0 and r.errors["h"].startswith("http_error")


def test_url_credentials_are_redacted_in_recorded_errors(server):
    """A URL's userinfo is sent (as Basic auth) but never recorded: an http grader's and a judge's errors
    quote their URL with ``[redacted]`` in its place."""
    creds = server.replace("http://", "http://grader-user:pw-s3cr3t@")
    _Handler.fail_first = 10
    r = score({"type": "http", "name": "h", "url": creds + "/score", "retries": 0}, "abcd")
    assert _Handler.calls[-1][2]["Authorization"].startswith("Basic ")
    judge = score(judge_spec(creds, retries=0), "good", {"question": "q"})
    for error in (r.errors["h"], judge.errors["judge"]):
        assert "HTTP 500" in error and "pw-s3cr3t" not in error and "grader-user" not in error, error
        assert "http://[redacted]@127.0.0.1:" in error


def judge_spec(server, **extra):
    return {
        "type": "score_model",
        "name": "judge",
        "base_url": server + "/v1",
        "model": "judge-1",
        "range": [0, 10],
        "api_key": "sk-test",
        "input": [
            {"role": "system", "content": "Rate the answer to {{item.question}} from 0 to 10."},
            {"role": "user", "content": "Answer: {{sample.output_text}}"},
        ],
        **extra,
    }


def test_score_model_judge(server):
    fn = build_reward(judge_spec(server, sampling_params={"temperature": 0, "max_tokens": 8}), LOCAL)
    res = fn.score_batch([{"question": "Q?"}] * 3, [sample("a good answer"), sample("meh"), sample("refuse")])
    fn.close()
    assert res[0].reward == pytest.approx(0.8) and res[1].reward == pytest.approx(0.2)
    assert res[2].reward == 0.0 and res[2].errors["judge"].startswith("invalid_output")
    path, body, headers = _Handler.calls[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "judge-1" and body["max_tokens"] == 8 and body["temperature"] == 0
    assert body["messages"][0] == {"role": "system", "content": "Rate the answer to Q? from 0 to 10."}
    assert body["messages"][1]["content"].startswith("Answer: ")


def test_score_model_range_clips_and_retries(server):
    _Handler.fail_first = 1
    r = score(judge_spec(server, range=[2, 4], retries=1, backoff_s=0), "good", {"question": "q"})
    assert r.reward == 1.0 and not r.errors  # "8/10" clipped to the top of [2, 4]


def test_batch_of_slow_graders_takes_one_graders_time(server):
    spec = {
        "type": "multi",
        "graders": {f"g{i}": {"type": "http", "url": server + "/score", "retries": 0} for i in range(4)},
    }
    fn = build_reward(spec, LOCAL)
    fn.score_batch([{}], [sample("warm-up")])  # imports httpx, opens the clients
    _Handler.delay = 0.5
    t0 = time.perf_counter()
    res = fn.score_batch([{}] * 8, [sample("ab")] * 8)
    elapsed = time.perf_counter() - t0
    fn.close()
    assert all(r.reward == pytest.approx(0.2) and not r.errors for r in res), [r.errors for r in res]
    assert elapsed < 2.5, f"32 calls of 0.5 s took {elapsed:.2f} s (sequential: 16 s)"


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from gspo_core.toy import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def test_reward_model_grader(reward_model_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["hello", "a different, longer text", "hello", "x"]
    items = [
        {"prompt": "Q: "},
        {"messages": [{"role": "user", "content": "Q: "}]},
        {"prompt": "Q: "},
        {"prompt": "Q: "},
    ]
    fn = build_reward({"type": "reward_model", "name": "rm", "model": str(reward_model_dir), "batch_size": 3})
    res = fn.score_batch(items, [sample(t) for t in texts])
    fn.close()
    assert all(0 < r.reward < 1 and not r.errors for r in res)
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    with torch.inference_mode():
        expected = [torch.sigmoid(model(**tok(["Q: " + t], return_tensors="pt")).logits[0, 0]).item() for t in texts]
    assert [r.reward for r in res] == pytest.approx(expected, abs=1e-5)  # padded batches == one by one
    assert res[0].reward != res[1].reward

    logit = build_reward(
        {
            "type": "reward_model",
            "model": str(reward_model_dir),
            "activation": "none",
            "input": "{{sample.output_text}}",
        }
    )
    r = logit.score_batch([{}], [sample("hello")])[0]
    logit.close()
    with torch.inference_mode():
        assert r.reward == pytest.approx(model(**tok(["hello"], return_tensors="pt")).logits[0, 0].item(), abs=1e-5)


def test_reward_model_missing_directory_scores_zero(tmp_path):
    fn = build_reward({"type": "reward_model", "name": "rm", "model": str(tmp_path / "absent")})
    res = fn.score_batch([{"prompt": "p"}] * 2, [sample("a"), sample("b")])
    fn.close()
    assert all(r.reward == 0.0 and r.errors["rm"].startswith("exception") for r in res)


def test_reward_models_are_loaded_once_per_process_and_the_cache_is_bounded(reward_model_dir, tmp_path):
    import shutil

    from gspo_core.rewards.reward_model import MODEL_CACHE, ModelCache

    dirs = [reward_model_dir] + [shutil.copytree(reward_model_dir, tmp_path / f"rm{i}") for i in range(2)]
    MODEL_CACHE.clear()
    loads = MODEL_CACHE.loads
    first = build_reward({"type": "reward_model", "model": str(dirs[0])})
    second = build_reward({"type": "reward_model", "model": str(dirs[0]), "activation": "none"})
    a = first.score_batch([{"prompt": "Q: "}], [sample("x")])[0]
    b = second.score_batch([{"prompt": "Q: "}], [sample("x")])[0]
    assert MODEL_CACHE.loads == loads + 1 and 0 < a.reward < 1 and not b.errors  # two graders, one load
    first.close()
    second.close()
    for d in dirs:  # three models, one after another: at most two stay loaded unused
        fn = build_reward({"type": "reward_model", "model": str(d)})
        assert not fn.score_batch([{"prompt": "Q: "}], [sample("x")])[0].errors
        fn.close()
    assert MODEL_CACHE.loads == loads + 3  # dirs[0] was still cached
    assert len(MODEL_CACHE) == 2

    small = ModelCache(max_models=4, max_bytes=1)  # no model fits: each leaves as soon as it is unused
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    def load():
        return AutoTokenizer.from_pretrained(dirs[1]), AutoModelForSequenceClassification.from_pretrained(dirs[1])

    entry = small.acquire((str(dirs[1]), "cpu"), load)
    assert small.acquire((str(dirs[1]), "cpu"), load) is entry and small.loads == 1  # held: kept and shared
    small.release((str(dirs[1]), "cpu"))
    small.release((str(dirs[1]), "cpu"))
    assert len(small) == 0


@pytest.mark.parametrize("url", ["http://[::1", "http://host:abc/"])
def test_a_url_httpx_cannot_parse_is_a_spec_error_naming_the_field(url):
    # httpx's InvalidURL is no ValueError: it escaped the check as a 500 before.
    with pytest.raises(RewardSpecError, match="url"):
        build_reward({"type": "http", "url": url})
    with pytest.raises(RewardSpecError, match="base_url"):
        build_reward({"type": "score_model", "model": "m", "input": [], "base_url": url})
