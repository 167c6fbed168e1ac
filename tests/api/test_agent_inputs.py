"""Agents at the API: rows' own `tools` checked at submit, MCP tool entries checked without a server, and
transcripts graded by /v1/rewards/run exactly as training grades an episode."""

from __future__ import annotations

import json

from gspo_core.rollout.base import Completion, EpisodeInfo
from gspo_core.step import grader_sample
from tests.api.conftest import job_body

HTTP_TOOL = {"type": "http", "name": "f", "server_url": "http://tool.invalid/f", "parameters": {"type": "object"}}
MCP_TOOL = {"type": "mcp", "server_url": "http://mcp.invalid/mcp", "allowed_tools": ["lookup"]}
AGENT_TOOL = {"type": "agent", "server_url": "http://agent.invalid/run"}


def _with_row_tools(dataset: bytes, line: int, names: list[str]) -> bytes:
    rows = [json.loads(raw) for raw in dataset.splitlines() if raw.strip()]
    rows[line - 1]["tools"] = [{"type": "function", "function": {"name": n}} for n in names]
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def test_rows_may_offer_only_the_jobs_tools(client, auth, toy_dataset, model_name):
    """A row naming a tool the job lacks is a 422 naming the file, the line and the field; with an MCP
    server among the tools the names wait for the job's start (its tools are listed then)."""
    bad = client.post("/v1/files", files={"file": ("t.jsonl", _with_row_tools(toy_dataset, 1, [""]))}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "tools[0].function.name", bad.text
    data = _with_row_tools(toy_dataset, 3, ["f", "lookup"])
    file_id = client.post("/v1/files", files={"file": ("t.jsonl", data)}, headers=auth).json()["id"]
    r = client.post("/v1/jobs", json={**job_body(file_id), "tools": [HTTP_TOOL]}, headers=auth)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "training_file.tools[1].function.name" and error["line"] == 3, error
    assert "'lookup'" in error["message"]
    r = client.post("/v1/jobs", json={**job_body(file_id), "tools": [HTTP_TOOL, MCP_TOOL]}, headers=auth)
    assert r.status_code == 201, r.text
    assert r.json()["tools"][1] == MCP_TOOL
    # OpenAI's view: an http tool in Agent RFT's shape (no type), any other kind keeps its type.
    shown = client.get(f"/v1/fine_tuning/jobs/{r.json()['id']}", headers=auth).json()["method"]["reinforcement"]
    http = {k: v for k, v in HTTP_TOOL.items() if k != "type"}
    assert shown["tools"] == [http, MCP_TOOL], shown
    plain = client.post("/v1/files", files={"file": ("p.jsonl", toy_dataset)}, headers=auth).json()["id"]
    r = client.post("/v1/jobs", json={**job_body(plain), "tools": [AGENT_TOOL]}, headers=auth)
    assert r.status_code == 201, r.text
    shown = client.get(f"/v1/fine_tuning/jobs/{r.json()['id']}", headers=auth).json()["method"]["reinforcement"]
    assert shown["tools"] == [AGENT_TOOL], shown


def test_a_transcript_is_graded_as_training_grades_the_episode(client, auth):
    """The python grader gets the sample a training step builds from the same episode."""
    call = {"id": "call_1_0", "type": "function", "function": {"name": "f", "arguments": '{"key": "a"}'}}
    turns = [
        {"role": "assistant", "content": "{f:a}", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1_0", "name": "f", "content": "aaa"},
        {"role": "assistant", "content": "aaa"},
    ]
    episode = Completion(0, [1], [5, 6, 7], [], "aaa", "stop", EpisodeInfo(turns=2, tool_calls=[call], messages=turns))
    trained = grader_sample(episode, "q:")
    expected = json.dumps({k: trained[k] for k in ("output_text", "output_tools", "messages", "output_json")})
    grader = {
        "type": "python",
        "source": f"import json\nEXPECTED = json.loads({expected!r})\n\n"
        "def grade(sample, item):\n    return float(all(sample[k] == v for k, v in EXPECTED.items()))\n",
    }
    body = {"reward": grader, "messages": trained["messages"]}
    r = client.post("/v1/rewards/run", json=body, headers=auth)
    assert r.status_code == 200, r.text
    ((result,),) = [r.json()["results"]]
    assert (result["output_text"], result["reward"], result["errors"]) == ("aaa", 1.0, {}), result
    other = json.loads(json.dumps(trained["messages"]))
    other[2]["content"] = "bbb"  # another tool result: the grader tells
    r = client.post("/v1/rewards/run", json={**body, "messages": other}, headers=auth)
    assert r.json()["results"][0]["reward"] == 0.0, r.text
    wrong = json.loads(json.dumps(trained["messages"]))
    wrong[1]["tool_calls"][0]["function"]["arguments"] = {"key": "a"}
    for patch, field in [
        ({"messages": wrong}, "messages[1].tool_calls[0].function.arguments"),
        ({"messages": trained["messages"][:1]}, "messages"),
        ({"messages": trained["messages"], "samples": ["x"]}, "messages"),
        ({}, "samples"),
    ]:
        r = client.post("/v1/rewards/run", json={"reward": grader, **patch}, headers=auth)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, (patch, r.text)
