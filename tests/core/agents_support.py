"""A tiny model taught (a few seconds of supervised steps) to call a tool in the toy format and then answer,
so that episode tests run real engines on real multi-turn trajectories."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from gspo_core.agents.render import tool_turn_ids
from gspo_core.config import GSPOConfig
from gspo_core.packing import pack
from gspo_core.policy import completion_logprobs, load_policy

PROMPT = "q:"
CALL = "{f:a}"
ANSWER = "ok"
RESULTS = ["1", "x y", "error: boom"]


def tool_calling_model(src: Path, out: Path, steps: int = 100) -> Path:
    """Copy of the tiny model at ``src`` that answers ``q:`` with ``{f:a}</s>`` and, after any tool result,
    ``ok</s>`` (supervised on exactly those ids, the environment's masked out as in GSPO's loss)."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    torch.manual_seed(0)
    model, tok = load_policy(str(out), GSPOConfig(), torch.device("cpu"))
    eos = [tok.eos_token_id]
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    call = tok(CALL, add_special_tokens=False)["input_ids"] + eos
    answer = tok(ANSWER, add_special_tokens=False)["input_ids"] + eos
    rows, masks = [], []
    for result in RESULTS:
        env = tool_turn_ids(tok, [{"role": "tool", "content": result}], tok.eos_token)
        rows.append(call + env + answer)
        masks.append([1] * len(call) + [0] * len(env) + [1] * len(answer))
    batch = pack([prompt] * len(rows), rows, tok.pad_token_id, masks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        logp_BT = completion_logprobs(model, batch, 1.0)
        (-(logp_BT.sum() / batch.mask_BT.sum())).backward()
        opt.step()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def episode_logprobs(model, completions, pad_id: int, temperature: float):
    """The trainer's log-probs of episodes, their environment tokens masked out, and the masked batch."""
    batch = pack(
        [c.prompt_ids for c in completions],
        [c.completion_ids for c in completions],
        pad_id,
        [c.mask for c in completions],
    )
    with torch.inference_mode():
        return completion_logprobs(model, batch, temperature), batch


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
    again. ``rewrite``: it rewrites its first message before asking again; ``grader``: it reports no reward;
    ``again`` (a row field): it asks a third time."""
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
    if item.get("again"):  # a third turn, past the job's max_turns: refused, the episode is over
        import openai

        try:
            client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError as exc:
            seen[session + "/again"] = exc.status_code
    return {} if item["mode"] == "grader" else {"reward": 1.0 if second.choices[0].message.content == "ok" else 0.5}


class AgentServer:
    """The user's agent server: POST ``{item, base_url, session}`` runs ``agent`` (:func:`run_agent`); ``fail``
    rows 500."""

    def __init__(self, agent=run_agent) -> None:
        self.seen: dict = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.headers["Authorization"] == "Bearer agent-key"
                if body["item"]["mode"] == "fail":
                    status, reply = 500, {"error": "the agent crashed"}
                else:
                    status, reply = 200, agent(body["item"], body["base_url"], outer.seen, body["session"])
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.spec = {
            "type": "agent",
            "server_url": f"http://127.0.0.1:{self.httpd.server_address[1]}/run",
            "headers": {"Authorization": "Bearer agent-key"},
            "timeout_s": 60,
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def check_agent_rollout(rollout, rows, seen, tok, logp_BT, mask_BT, endpoint, atol=1e-5) -> None:
    """The agent rollout of four kinds of sessions (``rows``' modes, two each; ``seen``: what each agent got)
    is what it should be: rows of exactly the sampled and the new messages' ids, the mask on the sampled
    ones, the recorded log-probs the trainer's (``logp_BT``, within ``atol``), prefix breaks and failures
    counted."""
    m = rollout.metrics
    assert (m["agent/prefix_breaks"], m["agent_errors/http_5xx"], m["rollouts_dropped"]) == (2, 2, 2)
    assert m["turns/mean"] == 1.5 and not endpoint.sessions
    for c in rollout.completions:
        mode = rows[c.prompt_index]["mode"]
        if mode == "fail":
            assert c.dropped and c.trained_mask == [0] * len(c.completion_ids)
            continue
        first, messages, second = seen[c.episode.outcome.session]
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
        assert c.episode.messages == [*messages, {"role": "assistant", "content": c.text}]
    assert len(seen) == 6
    for c in rollout.completions[:2]:  # the model really called f; the agent got the call in OpenAI's shape
        (call,) = seen[c.episode.outcome.session][0].choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"key": "a"})
        assert c.episode.tool_calls == [call.model_dump()] and c.text == "ok"
    for row, c in enumerate(rollout.completions):  # the recorded log-probs are the engine's, env ids at 0
        sampler = torch.tensor(c.logprobs) * mask_BT[row, : len(c.logprobs)]
        torch.testing.assert_close(logp_BT[row, : len(c.logprobs)], sampler, atol=atol, rtol=0)
