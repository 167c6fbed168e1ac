"""MCP tools against a real MCP server (the `mcp` SDK's own), per-row tools, and transcripts for graders."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from gspo_core import step as phases
from gspo_core.agents import ToolCall, ToolSpecError, build_toolbox, pick_format
from gspo_core.agents.episodes import EpisodeSettings
from gspo_core.agents.render import tool_turn_ids
from gspo_core.config import GSPOConfig
from gspo_core.data import DataError, check_row_tools, render_prompt, rows_with_tools, validate_jsonl_bytes
from gspo_core.policy import load_policy
from gspo_core.rollout.hf_engine import TransformersEngine
from tests.conftest import grader_policy
from tests.core.agents_support import CALL, PROMPT
from tests.core.mcp_support import McpToolServer
from tests.core.net_support import loopback_name
from tests.core.trainer_support import one_torch_thread

LOOPBACK = grader_policy(egress_allow=("127.0.0.1",))


@pytest.fixture
def mcp_server():
    server = McpToolServer()
    yield server
    server.close()


def test_mcp_tools_are_offered_filtered_and_called_in_a_session_per_episode(caller_dir, mcp_server):
    """The server's tools (less those allowed_tools leaves out) are the toolbox's; the taught model's call
    reaches the server and its answer is the environment ids after the sampled call; a row whose `tools`
    offer none gets `unknown_tool` instead; each calling episode had a session of its own, all closed. An
    episode whose result does not fit ends truncated, its call made once."""
    with pytest.raises(ToolSpecError, match=r"tools\[0\]\.server_url"):  # loopback: refused by default
        build_toolbox([mcp_server.spec()], grader_policy())
    box = build_toolbox([mcp_server.spec(allowed_tools=["f"])], LOOPBACK)
    assert box is not None and [s["function"]["name"] for s in box.schemas] == ["f"]
    assert box.schemas[0]["function"]["parameters"]["required"] == ["key"]
    with one_torch_thread():
        model, tok = load_policy(str(caller_dir), GSPOConfig(), torch.device("cpu"))
        cfg = GSPOConfig(prompts_per_step=2, group_size=2, max_new_tokens=64, max_turns=3, mini_batches=1)
        agent = EpisodeSettings(cfg.max_turns, 0, pick_format("auto", tok), box)
        rows = [{"prompt": PROMPT}, {"prompt": PROMPT, "tools": []}]
        call_ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        engine = TransformersEngine(model, tok)
        try:
            rollout = phases.sample(engine, tok, rows, [PROMPT] * 2, cfg, seed=3, agent=agent)
            server = box.servers[0]
            opened, left = server.opened, dict(server.sessions)
            # Room for "aaa" and the answer, not for the longer error text: those episodes end truncated while
            # the others go on, and their calls are not made again on the later turns.
            env = tool_turn_ids(tok, [{"role": "tool", "content": "aaa"}], tok.eos_token)
            short = cfg.model_copy(update={"max_new_tokens": len(call_ids) + len(env) + 4})
            cut = phases.sample(engine, tok, rows, [PROMPT] * 2, short, seed=3, agent=agent)
        finally:
            box.close()
    assert [c.finish_reason for c in cut.completions] == ["stop", "stop", "length", "length"]
    assert [len(c.episode.messages) for c in cut.completions] == [3, 3, 2, 2]
    assert cut.metrics["tool_errors/f/unknown_tool"] == 2 and len(mcp_server.calls) == 2 + 2
    env = tool_turn_ids(tok, [{"role": "tool", "content": "aaa"}], tok.eos_token)
    first, second = rollout.completions[:2], rollout.completions[2:]
    for c in first:
        assert c.completion_ids[: len(call_ids) + len(env)] == call_ids + env
        assert c.mask[len(call_ids) : len(call_ids) + len(env)] == [0] * len(env)
        assert c.episode.messages[1] == {"role": "tool", "tool_call_id": "call_1_0", "name": "f", "content": "aaa"}
    for c in second:
        assert c.episode.messages[1]["content"] == "error: no tool named 'f'"
    assert rollout.metrics["tool_errors/f/unknown_tool"] == 2
    assert mcp_server.calls == [("f", {"key": "a"})] * 4
    assert opened == 1 + 2 and left == {}  # the job start's listing, then one per calling episode


def test_mcp_error_results_reach_the_model_and_a_lost_server_drops_the_rollout(mcp_server):
    """A batch's calls run at once (four episodes' sessions); an isError result is the model's to read
    (counted); a server gone is tried 3 times, then dropped; a server that cannot be listed (or whose name
    resolves inside), or lacks an allowed tool, fails the toolbox's build naming the field."""
    box = build_toolbox([mcp_server.spec()], LOOPBACK)
    assert box is not None and sorted(box.tools) == ["boom", "f", "g", "slow"]
    try:
        start = time.perf_counter()
        assert [r.text for r in box.call_many([ToolCall("slow")] * 4, [1, 2, 3, 4])] == ["late"] * 4
        assert time.perf_counter() - start < 1.5  # 4 x 0.5 s one after the other: they ran at once
        boom, f = box.call_many([ToolCall("boom"), ToolCall("f", {"_": "b"})], [7, 7])
        assert (boom.error, boom.drop, "boom" in boom.text) == ("tool_error", False, True)
        assert (f.text, f.error) == ("bbb", None)
        box.end_episodes([1, 2, 3, 4, 7])
        assert box.servers[0].sessions == {}
        mcp_server.close()
        (gone,) = box.call_many([ToolCall("g")], [8])
        assert (gone.error, gone.drop) == ("connection", True)
    finally:
        box.close()
    with pytest.raises(ToolSpecError, match="could not list") as info:
        build_toolbox([{**mcp_server.spec(), "server_url": f"http://127.0.0.1:{_free_port()}/mcp"}], LOOPBACK)
    assert info.value.field == "tools[0].server_url"
    name, _ = loopback_name()  # a name (not a literal) that resolves inside: refused when connecting
    with pytest.raises(ToolSpecError, match=r"EgressRefusedError: .* loopback"):
        build_toolbox([{**mcp_server.spec(), "server_url": f"http://{name}:{_free_port()}/mcp"}], grader_policy())


def test_mcp_allowed_tools_must_be_listed(mcp_server):
    with pytest.raises(ToolSpecError, match="no tool named 'h'") as info:
        build_toolbox([mcp_server.spec(allowed_tools=["f", "h"])], LOOPBACK)
    assert info.value.field == "tools[0].allowed_tools"


def test_rows_narrow_the_tools_they_offer(tiny_model_dir):
    """A row's `tools` (OpenAI's dataset format): its shape is checked at upload, its names against the
    job's tools, and the chat template is offered only those."""
    from transformers import AutoTokenizer

    with pytest.raises(DataError) as info:
        validate_jsonl_bytes(b'{"prompt": "x"}\n{"prompt": "x", "tools": [{"type": "function", "function": {}}]}\n')
    assert (info.value.line, info.value.field) == (2, "tools[0].function.name")
    offers_g = b'"tools": [{"type": "function", "function": {"name": "g"}}]'
    rows = validate_jsonl_bytes(b'{"messages": [{"role": "user", "content": "hi"}], ' + offers_g + b"}\n")
    check_row_tools(enumerate(rows, 1), {"f", "g"})
    stored = b'{"prompt": "x"}\n\n{"prompt": "y", ' + offers_g + b"}"  # as the API streams a file at submit
    for size in (1, 5, 4096):
        chunks = (stored[i : i + size] for i in range(0, len(stored), size))
        assert [(line, row["prompt"]) for line, row in rows_with_tools(chunks)] == [(3, "y")]
    with pytest.raises(DataError) as info:
        check_row_tools(enumerate(rows, 1), {"f"})
    assert (info.value.line, info.value.field) == (1, "tools[0].function.name") and "'g'" in str(info.value)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    schemas = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("f", "g")]
    assert render_prompt(rows[0], tok, schemas) == "[g]hi"
    assert render_prompt({"messages": rows[0]["messages"]}, tok, schemas) == "[f][g]hi"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_job_start_lists_the_servers_and_checks_the_rows_tools(caller_dir, tmp_path, mcp_server):
    """The worker's start of a job: an unreachable MCP server fails it naming the field; a row naming a tool
    that neither the job nor its servers have fails it naming the file and the row."""
    from gspo_core.config import JobSpec
    from tests.core.trainer_support import Recorder, train

    data = tmp_path / "rows.jsonl"
    data.write_text(f'{{"prompt": "{PROMPT}"}}\n{{"prompt": "{PROMPT}", "tools": [{{"function": {{"name": "h"}}}}]}}\n')
    spec = {
        "model": str(caller_dir),
        "training_file": str(data),
        "reward": {"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}", "reference": "ok"},
        "tools": [{**mcp_server.spec(), "server_url": f"http://127.0.0.1:{_free_port()}/mcp"}],
        "hyperparameters": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_turns": 2, "mini_batches": 1},
        "output_dir": str(tmp_path / "out"),
    }
    with pytest.raises(ToolSpecError, match=r"tools\[0\]\.server_url: could not list the tools of the MCP server"):
        train(JobSpec(**spec), Recorder(), grader_policy=LOOPBACK)
    spec["tools"] = [mcp_server.spec()]
    with pytest.raises(DataError, match="training_file: row 2: no tool named 'h' in the job"):
        train(JobSpec(**spec), Recorder(), grader_policy=LOOPBACK)
