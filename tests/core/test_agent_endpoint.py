"""Bring your own agent: a real agent server, written against the official `openai` client, runs each rollout
against the service's chat endpoint; the trained ids are exactly the sampled ids and the new messages'."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from gspo_core import step as phases
from gspo_core.agents import ToolSpecError, build_toolbox, pick_format
from gspo_core.agents.episodes import EpisodeSettings
from gspo_core.agents.remote import AgentEndpoint
from gspo_core.agents.render import tool_turn_ids
from gspo_core.config import GSPOConfig
from gspo_core.policy import load_policy
from gspo_core.rewards import build_reward
from gspo_core.rollout.hf_engine import TransformersEngine
from tests.conftest import grader_policy
from tests.core.agents_support import episode_logprobs
from tests.core.trainer_support import one_torch_thread

#: The toy template, but a user's message is its bare text and follows no header: the first request renders to
#: exactly the prompt the tool-calling model was taught on, its tool results as it was taught.
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% else %}<|{{ m.role }}|>{{ m.content }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt and messages[-1].role != 'user' %}<|assistant|>{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]


def run_agent(item: dict, base_url: str, seen: dict, session: str) -> dict:
    """A plain agent loop on the `openai` client: ask, run the tool the model called (or say "go on"), ask
    again. ``rewrite``: it rewrites its first message before asking again; ``grader``: it reports no reward."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    messages: list[dict] = [{"role": "user", "content": item["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=16)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        key = json.loads(call.function.arguments).get("key", "")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": key * 3})
    if not message.tool_calls:
        messages.append({"role": "user", "content": "go on"})
    if item["mode"] == "rewrite":
        messages[0] = {"role": "user", "content": item["prompt"] + " (summary)"}
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    seen[session] = (first, messages, second)
    return {} if item["mode"] == "grader" else {"reward": 1.0 if second.choices[0].message.content == "ok" else 0.5}


class AgentServer:
    """The user's agent server: POST ``{item, base_url, session}`` runs :func:`run_agent`; ``fail`` rows 500."""

    def __init__(self) -> None:
        self.seen: dict = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.headers["Authorization"] == "Bearer agent-key"
                if body["item"]["mode"] == "fail":
                    status, reply = 500, {"error": "the agent crashed"}
                else:
                    status, reply = 200, run_agent(body["item"], body["base_url"], outer.seen, body["session"])
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.spec = {
            "type": "agent",
            "server_url": f"http://127.0.0.1:{self.httpd.server_address[1]}/run",
            "headers": {"Authorization": "Bearer agent-key"},
            "timeout_s": 60,
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def agent_server():
    server = AgentServer()
    yield server
    server.close()


def test_agent_specs_are_validated_with_field_names(agent_server):
    policy = grader_policy(egress_allow=("127.0.0.1",))
    assert build_toolbox([agent_server.spec], policy) is None  # valid: the agent is the environment
    py = {"type": "python", "source": "def f(key: str) -> str:\n    return key\n"}
    for tools, where in [
        ([agent_server.spec], "tools[0].server_url"),  # loopback refused unless allow-listed
        ([py, agent_server.spec], "tools[0]"),
        ([agent_server.spec, agent_server.spec], "tools[1]"),
        ([{**agent_server.spec, "name": "x"}], "tools[0].name"),
        ([{**agent_server.spec, "timeout_s": 0}], "tools[0].timeout_s"),
        ([{**agent_server.spec, "headers": {"Host": "x"}}], "tools[0].headers.Host"),
    ]:
        with pytest.raises(ToolSpecError) as info:
            build_toolbox(tools, grader_policy() if where == "tools[0].server_url" else policy)
        assert info.value.field == where, tools


def test_an_openai_client_agent_trains_on_exactly_the_sampled_ids(caller_dir, agent_server):
    """Sessions of four kinds, two each: an agent that calls its tool and reports a reward, one that
    rewrites its history (a prefix break: the row starts anew from the rewritten request), one whose server
    fails (dropped, counted), one that leaves the reward to the job's grader."""
    with one_torch_thread():
        model, tok = load_policy(str(caller_dir), GSPOConfig(), torch.device("cpu"))
        tok.chat_template = TEMPLATE
        cfg = GSPOConfig(prompts_per_step=4, group_size=2, max_new_tokens=48, max_turns=3, mini_batches=1)
        parser, policy = pick_format("auto", tok), grader_policy(egress_allow=("127.0.0.1",))
        endpoint = AgentEndpoint(agent_server.spec, policy, parser, 64)
        settings = EpisodeSettings(cfg.max_turns, 0, parser, None, endpoint)
        rows = [{"prompt": "q:", "mode": m, "answer": "ok"} for m in ("tool", "rewrite", "fail", "grader")]
        try:
            rollout = phases.sample(TransformersEngine(model, tok), tok, rows, ["q:"] * 4, cfg, seed=3, agent=settings)
        finally:
            endpoint.close()
        logp_BT, masked = episode_logprobs(model, rollout.completions, tok.pad_token_id, cfg.temperature)
    m = rollout.metrics
    assert (m["agent/prefix_breaks"], m["agent_errors/http_5xx"], m["rollouts_dropped"]) == (2, 2, 2)
    assert m["turns/mean"] == 1.5 and not endpoint.sessions
    for c in rollout.completions:
        mode = rows[c.prompt_index]["mode"]
        if mode == "fail":
            assert c.dropped and c.trained_mask == [0] * len(c.completion_ids)
            continue
        first, messages, second = agent_server.seen[c.extra["agent"]["session"]]
        ask = [{"role": "user", "content": "q:"}]
        if mode == "rewrite":  # the row is the rewritten request's context and its one sampled turn
            ask = messages
        prompt = tok.apply_chat_template(ask, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert c.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
        last = tok(second.choices[0].message.content, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert second.usage.completion_tokens == len(last) and c.completion_ids[-len(last) :] == last
        if mode != "rewrite":
            turn1 = tok(first.choices[0].message.content, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            env = tool_turn_ids(tok, messages[2:], tok.eos_token)
            assert first.usage.completion_tokens == len(turn1) and first.usage.prompt_tokens == len(c.prompt_ids)
            assert c.completion_ids == turn1 + env + last
            assert c.mask == [1] * len(turn1) + [0] * len(env) + [1] * len(last)
        else:
            assert c.completion_ids == last and c.mask == [1] * len(last)
        assert c.extra["messages"] == [*messages, {"role": "assistant", "content": c.text}]
    assert len(agent_server.seen) == 6
    for c in rollout.completions[:2]:  # the model really called f; the agent got the call in OpenAI's shape
        (call,) = agent_server.seen[c.extra["agent"]["session"]][0].choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"key": "a"})
        assert c.extra["tool_calls"] == [call.model_dump()] and c.text == "ok"
    for row, c in enumerate(rollout.completions):  # the recorded log-probs are the engine's, env ids at 0
        sampler = torch.tensor(c.logprobs) * masked.mask_BT[row, : len(c.logprobs)]
        torch.testing.assert_close(logp_BT[row, : len(c.logprobs)], sampler, atol=1e-5, rtol=0)
    grader = {"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}", "reference": "ok"}
    reward = build_reward(grader, grader_policy())
    try:
        rewards = phases.score(reward, rollout).rewards_N.tolist()
    finally:
        reward.close()
    agents = [1.0 if c.text == "ok" else 0.5 for c in rollout.completions[:4]]
    graded = [1.0 if c.text == "ok" else 0.0 for c in rollout.completions[6:]]
    assert rewards == [*agents, 0.0, 0.0, *graded]


def test_a_job_with_an_agent_trains_on_its_rewards(caller_dir, tmp_path, agent_server):
    """Through the trainer (the job's `tools` as given in YAML or POST /v1/jobs): the endpoint opens for
    the job, the agents' rewards are the step's rewards, and the stored samples show their transcripts."""
    from gspo_core.config import JobSpec
    from tests.core.trainer_support import Recorder, train

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "q:", "mode": "tool"}\n' * 2)
    spec = JobSpec(
        model=str(caller_dir),
        training_file=str(data),
        reward={"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}", "reference": "x"},
        tools=[agent_server.spec],
        hyperparameters={"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_turns": 2, "mini_batches": 1},
        output_dir=str(tmp_path / "out"),
    )
    rec = Recorder()
    with one_torch_thread():
        train(spec, rec, grader_policy=grader_policy(egress_allow=("127.0.0.1",)))
    ((_, metrics),) = rec.steps
    said = [second.choices[0].message.content for _, _, second in agent_server.seen.values()]
    assert len(said) == 4 and metrics["reward/mean"] == pytest.approx(sum(1.0 if s == "ok" else 0.5 for s in said) / 4)
    assert metrics["turns/mean"] == 2 and metrics["agent/prefix_breaks"] == 0 and metrics["rollouts_dropped"] == 0
    shown = rec.samples[0][1][0]["completions"][0]
    assert shown["messages"][0] == {"role": "user", "content": "q:"} and shown["turns"] == 2
