"""A task only a tool solves, trained with GSPO: the answer is the letter a local HTTP tool returns at random.

The tiny model is first taught the format only (call ``{f}``, then answer one letter drawn at random, i.e.
at chance: 1/12), then GSPO trains it with two-turn episodes; the reward is 1 when the answer is the tool's
letter. Usage: ``python -m bench.agents_tool_task [transformers|vllm] [steps] [learning_rate]``
(docs/agents.md has the measured curve)."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from gspo_core.agents.render import tool_turn_ids
from gspo_core.callbacks import Callbacks
from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.packing import pack
from gspo_core.platform import RuntimeOptions
from gspo_core.policy import completion_logprobs, load_policy
from gspo_core.rewards import GraderPolicy
from gspo_core.toy import build_tiny_model
from gspo_core.trainer import train

LETTERS = "abcdefghijkl"
GRADE = (
    "def grade(s, i):\n    tools = [m['content'] for m in s['messages'] if m['role'] == 'tool']\n"
    "    return float(bool(tools) and s['output_text'][:1] == tools[-1])\n"
)


def tool_server() -> ThreadingHTTPServer:
    rng = random.Random(0)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = rng.choice(LETTERS).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def format_only_model(out: Path) -> Path:
    """The tiny model taught to call ``{f}`` after ``key:`` and to answer one letter, drawn independently of
    the tool's result (so the answer is at chance before GSPO)."""
    shutil.copytree(build_tiny_model(out.parent / "tiny"), out, dirs_exist_ok=True)
    model, tok = load_policy(str(out), GSPOConfig(), torch.device("cpu"))
    prompt = tok("key:", add_special_tokens=False)["input_ids"]
    call = tok("{f}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rng, opt = random.Random(1), torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(80):
        rows, masks = [], []
        for _ in range(48):
            env = tool_turn_ids(tok, [{"role": "tool", "content": rng.choice(LETTERS)}], tok.eos_token)
            answer = tok(rng.choice(LETTERS), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rows.append(call + env + answer)
            masks.append([1] * len(call) + [0] * len(env) + [1] * len(answer))
        batch = pack([prompt] * len(rows), rows, tok.pad_token_id, masks)
        opt.zero_grad()
        (-(completion_logprobs(model, batch, 1.0).sum() / batch.mask_BT.sum())).backward()
        opt.step()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


class Curve(Callbacks):
    def __init__(self) -> None:
        self.reward: list[float] = []
        self.calls: list[float] = []

    def on_step(self, step, metrics):
        self.reward.append(metrics["reward/mean"])
        self.calls.append(metrics.get("tool_calls/mean", 0.0))


def main() -> None:
    engine = sys.argv[1] if len(sys.argv) > 1 else "transformers"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    lr = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-3
    torch.set_num_threads(1)
    server, work = tool_server(), Path(tempfile.mkdtemp(prefix="agents-bench-"))
    data = work / "rows.jsonl"
    data.write_text('{"prompt": "key:"}\n' * 64)
    spec = JobSpec(
        model=str(format_only_model(work / "model")),
        training_file=str(data),
        output_dir=str(work / "out"),
        reward={"type": "python", "source": GRADE},
        tools=[
            {
                "type": "http",
                "name": "f",
                "description": "a letter",
                "parameters": {"type": "object", "properties": {}},
                "server_url": f"http://127.0.0.1:{server.server_address[1]}/f",
            }
        ],
        hyperparameters={
            "steps": steps,
            "prompts_per_step": 8,
            "group_size": 8,
            "max_turns": 2,
            "max_turn_tokens": 6,
            "max_new_tokens": 32,
            "learning_rate": lr,
            "mini_batches": 1,
            "tool_format": "toy",
        },
    )
    policy = GraderPolicy(python=os.environ.get("GSPO_GRADER_PYTHON"), egress_allow=("127.0.0.1",))
    curve, start = Curve(), time.time()
    train(spec, curve, grader_policy=policy, runtime=RuntimeOptions(rollout_engine=engine))
    every = max(1, steps // 15)
    print(
        json.dumps(
            {
                "engine": engine,
                "wall_s": round(time.time() - start, 1),
                f"reward_per_{every}_steps": [
                    round(sum(curve.reward[i : i + every]) / every, 3) for i in range(0, steps, every)
                ],
                "tool_calls": [round(sum(curve.calls[i : i + every]) / every, 2) for i in range(0, steps, every)],
            }
        )
    )
    server.shutdown()


if __name__ == "__main__":
    main()
