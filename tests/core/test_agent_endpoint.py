"""Bring your own agent: a real agent server, written against the official `openai` client, runs each rollout
against the service's chat endpoint; the trained ids are exactly the sampled ids and the new messages'."""

from __future__ import annotations

import socket

import pytest
import torch

from gspo_core import step as phases
from gspo_core.agents import ToolSpecError, build_toolbox, pick_format
from gspo_core.agents.episodes import EpisodeSettings
from gspo_core.agents.remote import AgentEndpoint
from gspo_core.config import GSPOConfig
from gspo_core.platform import RuntimeOptions
from gspo_core.policy import load_policy
from gspo_core.rewards import build_reward
from gspo_core.rollout.hf_engine import TransformersEngine
from tests.conftest import grader_policy
from tests.core.agents_support import TEMPLATE, check_agent_rollout, episode_logprobs
from tests.core.trainer_support import one_torch_thread


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
    check_agent_rollout(rollout, rows, agent_server.seen, tok, logp_BT, masked.mask_BT, endpoint)
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
    data.write_text('{"prompt": "q:", "mode": "tool", "again": true}\n' * 2)
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
    refused = [agent_server.seen.pop(k) for k in list(agent_server.seen) if k.endswith("/again")]
    assert refused == [400] * 4  # max_turns 2: a third request is refused, the episode is over
    said = [second.choices[0].message.content for _, _, second in agent_server.seen.values()]
    assert len(said) == 4 and metrics["reward/mean"] == pytest.approx(sum(1.0 if s == "ok" else 0.5 for s in said) / 4)
    assert metrics["turns/mean"] == 2 and metrics["agent/prefix_breaks"] == 0 and metrics["rollouts_dropped"] == 0
    shown = rec.samples[0][1][0]["completions"][0]
    assert shown["messages"][0] == {"role": "user", "content": "q:"} and shown["turns"] == 2


def test_chat_requests_and_agent_replies_are_read_strictly(agent_server):
    """What the endpoint refuses (OpenAI-style 400s), how it compares a message sent back with the one it
    produced, how an agent's reward is read, and that a session id it did not open is a 404."""
    import json
    import urllib.error
    import urllib.request

    from gspo_core.agents.chat import ChatRequest, RequestError, parse_request, reward_of, same_message

    user = [{"role": "user", "content": "x"}]
    for req, why in [
        ("{", "not JSON"),
        ({"messages": []}, "messages"),
        ({"messages": user, "stream": True}, "stream"),
        ({"messages": user, "n": 2}, "n:"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role"),
        ({"messages": user, "max_tokens": -1}, "max_tokens"),
        ("[" * 100_000, "not JSON"),  # nested past the parser's recursion
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, r"messages\[0\].content\[0\]"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]}, r"messages\[0\].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, r"messages\[0\].tool_calls:"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
            "arguments",
        ),
        ({"messages": user, "tools": {"f": 1}}, "tools: must be a list"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": ""}}]}, r"tools\[0\].function.name"),
        ({"messages": user, "tools": [{"function": {"name": "f", "parameters": {"properties": 1}}}]}, "parameters"),
    ]:
        with pytest.raises(RequestError, match=why):
            parse_request(req.encode() if isinstance(req, str) else json.dumps(req).encode())
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": None}]
    assert parse_request(json.dumps({"messages": parts, "max_completion_tokens": 5}).encode()) == ChatRequest(
        [{"role": "user", "content": "ab"}], None, 5
    )
    call = {"id": "call_1_0", "type": "function", "function": {"name": "f", "arguments": '{"key": "a"}'}}
    ours = {"role": "assistant", "content": "{f:a}", "tool_calls": [call]}
    sdk = {
        **ours,
        "refusal": None,
        "tool_calls": [{**call, "id": "other", "function": {**call["function"], "arguments": '{"key":"a"}'}}],
    }
    assert same_message(ours, sdk) and not same_message(ours, {**sdk, "content": "{f:b}"})
    deep = {**call, "function": {"name": "f", "arguments": "[" * 100_000}}  # a string, but nested past the parser
    assert not same_message(ours, {**ours, "tool_calls": [deep]})
    huge = b'{"reward": -' + b"9" * 400 + b"}"  # float() of it raises: clipped as an integer
    assert [reward_of(body) for body in (b'{"reward": 99}', huge, b'{"reward": 0.25}', b"", b'{"ok": 1}', b"[1]")] == [
        (10.0, None),
        (-10.0, None),
        (0.25, None),
        (None, None),
        (None, None),
        (None, None),
    ]
    assert {reward_of(body) for body in (b'{"reward": "1"}', b'{"reward": true}', b'{"reward": NaN}')} == {
        (None, "bad_reward")
    }
    endpoint = AgentEndpoint(agent_server.spec, grader_policy(), pick_format("toy", None), 64)
    try:
        for path in ("/s/nope/v1/chat/completions", "/elsewhere"):
            request = urllib.request.Request(endpoint.base + path, data=json.dumps({"messages": user}).encode())
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=5)
            assert info.value.code == 404
    finally:
        endpoint.close()
    # The operator's address for agents on other machines: a fixed port, and the URL they reach it at.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    runtime = RuntimeOptions(agent_endpoint_port=port, agent_endpoint_url=f"http://localhost:{port}/")
    endpoint = AgentEndpoint(
        agent_server.spec,
        grader_policy(),
        pick_format("toy", None),
        64,
        runtime.agent_endpoint_host,
        runtime.agent_endpoint_port,
        runtime.agent_endpoint_url,
    )
    try:
        assert endpoint.base == f"http://localhost:{port}"
        with pytest.raises(urllib.error.HTTPError) as info:  # reached under that name: no such session
            urllib.request.urlopen(endpoint.base + "/s/nope/v1/models", timeout=5)
        assert info.value.code == 404
    finally:
        endpoint.close()
    with pytest.raises(ValueError, match="agent_endpoint_port"):
        RuntimeOptions(agent_endpoint_port=70000)
