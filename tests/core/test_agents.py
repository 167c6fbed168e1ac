"""Multi-turn episodes with tools: call formats, environment tokens, exact provenance, Agent RFT errors."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from gspo_core import step as phases
from gspo_core.agents import ToolCall, ToolSpecError, build_toolbox, pick_format
from gspo_core.agents.episodes import EpisodeSettings
from gspo_core.agents.formats import parse_hermes, parse_toy
from gspo_core.agents.render import tool_turn_ids, tool_turn_text
from gspo_core.config import GSPOConfig
from gspo_core.packing import pack
from gspo_core.policy import load_policy
from gspo_core.rewards import build_reward
from gspo_core.rollout.hf_engine import TransformersEngine
from tests.conftest import grader_policy
from tests.core.agents_support import ANSWER, CALL, PROMPT, episode_logprobs
from tests.core.trainer_support import one_torch_thread

PY_TOOL = {"type": "python", "source": 'def f(key: str) -> str:\n    """Look a key up."""\n    return key * 3\n'}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def test_call_formats():
    calls = parse_hermes(
        'x<tool_call>\n{"name": "f", "arguments": {"key": "a"}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"n\\": 2}"}</tool_call><tool_call>{oops</tool_call>'
    )
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("f", {"key": "a"}, True),
        ("g", {"n": 2}, True),
        ("", {}, False),
    ]
    assert parse_hermes("no calls") == [] and parse_toy("{f:a} and {g}") == [
        ToolCall("f", {"_": "a"}),
        ToolCall("g", {}),
    ]


def test_tool_results_follow_the_exact_sampled_turn_through_the_template(tiny_model_dir):
    """A Qwen3-style template drops earlier <think> blocks when it renders a history: re-rendering the
    transcript would change the ids the model sampled. Only the suffix after the sampled turn is rendered."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response>\n"
        "{% else %}<|{{ m.role }}|>{{ m.content.split('</think>')[-1] }}</s>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    sampled = tok("<think>hm</think>{f:a}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    env = tool_turn_ids(tok, [{"role": "tool", "content": "aaa"}], tok.eos_token)
    assert tool_turn_text(tok, [{"role": "tool", "content": "aaa"}], "</s>") == (
        "\n<|user|><tool_response>aaa</tool_response>\n<|assistant|>"
    )
    rerendered = tok.apply_chat_template(
        [{"role": "assistant", "content": "<think>hm</think>{f:a}"}, {"role": "tool", "content": "aaa"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<think>" not in rerendered  # the history rewrite a re-tokenising loop would train on
    assert tok.decode(sampled + env).startswith("<think>hm</think>{f:a}</s>")


def test_tool_specs_are_validated_with_field_names():
    policy = grader_policy()
    for tools, where in [
        ([{"type": "nope"}], "tools[0].type"),
        ([{"type": "mcp"}], "tools[0].server_url"),
        ([{"type": "mcp", "server_url": "http://127.0.0.1:9/mcp"}], "tools[0].server_url"),
        ([{"type": "mcp", "server_url": "http://example.com/mcp", "allowed_tools": "f"}], "tools[0].allowed_tools"),
        ([{"type": "mcp", "server_url": "http://example.com/mcp", "headers": {"Host": "x"}}], "tools[0].headers.Host"),
        ([{"type": "mcp", "server_url": "http://example.com/mcp", "name": "f"}], "tools[0].name"),
        ([{"type": "python", "source": "def f(x):\n    return x\n"}], "tools[0].source"),
        ([{"type": "python", "source": "def (:"}], "tools[0].source"),
        ([PY_TOOL, {"type": "http", "name": "f", "server_url": "http://example.com"}], "tools[1]"),
        ([{"type": "http", "name": "g", "server_url": "http://127.0.0.1:9/x"}], "tools[0].server_url"),
        ([{"type": "http", "name": "g", "server_url": "ftp://x"}], "tools[0].server_url"),
        ([{"type": "http", "name": "g", "server_url": "http://example.com", "bogus": 1}], "tools[0].bogus"),
    ]:
        with pytest.raises(ToolSpecError) as info:
            build_toolbox(tools, policy)
        assert info.value.field == where, tools
    box = build_toolbox([PY_TOOL], policy)
    assert box is not None and box.schemas[0]["function"]["parameters"]["required"] == ["key"]
    box.close()


def test_episodes_train_exactly_the_sampled_ids(caller_dir):
    """Two-turn episodes (call, tool result, answer) with a python tool in the sandbox: the trained ids are
    the sampled ids and the environment's, the mask is 1 on exactly the sampled ones (the trainer's own
    log-probs of them equal the sampler's), and graders see the answer, the calls and the transcript."""
    model, tok = load_policy(str(caller_dir), GSPOConfig(), torch.device("cpu"))
    box = build_toolbox([PY_TOOL], grader_policy())
    cfg = GSPOConfig(prompts_per_step=2, group_size=4, max_new_tokens=64, max_turns=3, mini_batches=1)
    agent = EpisodeSettings(cfg.max_turns, 0, pick_format("auto", tok), box)
    try:
        rollout = phases.sample(TransformersEngine(model, tok), tok, [{}, {}], [PROMPT] * 2, cfg, seed=3, agent=agent)
    finally:
        box.close()
    assert rollout.metrics["turns/mean"] == 2 and rollout.metrics["tool_calls/mean"] == 1
    assert rollout.metrics["rollouts_dropped"] == 0 and rollout.metrics["time/tools"] > 0
    call_ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for c in rollout.completions:
        env = tool_turn_ids(tok, [{"role": "tool", "content": "aaa"}], tok.eos_token)
        assert c.completion_ids[: len(call_ids) + len(env)] == call_ids + env
        assert c.mask == [1] * len(call_ids) + [0] * len(env) + [1] * (len(c.completion_ids) - len(call_ids) - len(env))
        assert c.text == ANSWER and c.episode.messages[1]["content"] == "aaa"
    batch = pack([c.prompt_ids for c in rollout.completions], [c.completion_ids for c in rollout.completions], 0)
    logp_BT, masked = episode_logprobs(model, rollout.completions, tok.pad_token_id, cfg.temperature)
    for row, c in enumerate(rollout.completions):
        sampler = torch.tensor(c.logprobs) * masked.mask_BT[row, : len(c.logprobs)]
        torch.testing.assert_close(logp_BT[row, : len(c.logprobs)], sampler, atol=1e-5, rtol=0)
    assert batch.mask_BT.sum() > masked.mask_BT.sum()
    reward = build_reward(
        {
            "type": "python",
            "source": "def grade(s, i):\n    return float(s['output_tools'][0]['function']"
            "['name'] == 'f' and s['messages'][-1]['content'] == s['output_text'])\n",
        },
        grader_policy(),
    )
    try:
        assert phases.score(reward, rollout).rewards_N.tolist() == [1.0] * 8
    finally:
        reward.close()


class ToolServer:
    """A real local tool endpoint: ``/ok`` answers 200, ``/missing`` 404 with a text, ``/down`` 503,
    ``/slow`` after 2 s; every request is counted by path."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.hits[self.path] = outer.hits.get(self.path, 0) + 1
                if self.path == "/slow":
                    time.sleep(2)
                status, text = {"/ok": (200, b"got " + body), "/missing": (404, b"no such key")}.get(
                    self.path, (503, b"busy")
                )
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                except BrokenPipeError:  # /slow: the client gave up, as it should
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def tool(self, path: str, name: str = "f") -> dict:
        return {
            "type": "http",
            "name": name,
            "description": "look a key up",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
            "server_url": f"http://127.0.0.1:{self.httpd.server_address[1]}{path}",
            "timeout_s": 0.5,
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def tool_server():
    server = ToolServer()
    yield server
    server.close()


def test_http_tools_follow_agent_rft_error_semantics(tool_server):
    """200 and 404 texts reach the model (the 404 counted as an error); a 503 is tried 3 times and a
    timeout is its own kind, both dropping the rollout; loopback is refused unless allow-listed."""
    with pytest.raises(ToolSpecError, match=r"tools\[0\]\.server_url"):
        build_toolbox([tool_server.tool("/ok")], grader_policy())
    paths = ["/ok", "/missing", "/down", "/slow"]
    box = build_toolbox(
        [tool_server.tool(p, f"t{i}") for i, p in enumerate(paths)], grader_policy(egress_allow=("127.0.0.1",))
    )
    assert box is not None
    try:
        results = box.call_many([ToolCall(f"t{i}", {"key": "a"}) for i in range(4)] + [ToolCall("t0", {})])
    finally:
        box.close()
    assert [(r.text, r.error, r.drop) for r in results[:2]] == [
        ('got {"key":"a"}', None, False),
        ("no such key", "http_4xx", False),
    ]
    assert (results[2].error, results[2].drop, tool_server.hits["/down"]) == ("http_5xx", True, 3)
    assert (results[3].error, results[3].drop) == ("timeout", True)
    assert results[4].error == "bad_arguments" and tool_server.hits["/ok"] == 1


def test_a_job_whose_tool_fails_drops_and_counts_its_rollouts(caller_dir, tmp_path, tool_server):
    """Through the trainer: every episode calls an endpoint that answers 503: the rollouts are dropped and
    counted, not graded, and train nothing (a zero gradient step); the tool errors are counted by kind."""
    from tests.core.trainer_support import Recorder, train

    data = tmp_path / "rows.jsonl"
    data.write_text(f'{{"prompt": "{PROMPT}"}}\n' * 4)
    spec = {
        "model": str(caller_dir),
        "training_file": str(data),
        "reward": {"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}", "reference": "ok"},
        "tools": [tool_server.tool("/down")],
        "hyperparameters": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_turns": 2, "mini_batches": 1},
        "output_dir": str(tmp_path / "out"),
    }
    from gspo_core.config import JobSpec

    rec = Recorder()
    train(JobSpec(**spec), rec, grader_policy=grader_policy(egress_allow=("127.0.0.1",)))
    ((_, metrics),) = rec.steps
    assert metrics["rollouts_dropped"] == 4 and metrics["tool_errors/f/http_5xx"] == 4
    assert metrics["turns/mean"] == 1 and metrics["grad_norm"] == 0  # dropped: nothing of theirs is trained
    assert metrics["tokens/sampled"] == 4 * metrics["completion/len_mean"] > 0  # but they were sampled
    assert tool_server.hits["/down"] == 12
    shown = rec.samples[0][1][0]["completions"][0]
    assert shown["dropped"] and shown["trained_tokens"] == 0 and shown["messages"][-1]["role"] == "tool"


def test_a_template_without_a_tool_role_falls_back_to_the_fixed_format(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    )
    assert tool_turn_text(tok, [{"role": "tool", "content": "7"}], "</s>") == "\n<tool_result>\n7\n</tool_result>\n"
    tok.chat_template = None
    assert tool_turn_text(tok, [{"role": "tool", "content": "7"}], "") == "\n<tool_result>\n7\n</tool_result>\n"
