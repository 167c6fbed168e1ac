"""A task only a tool solves, trained with GSPO: the answer is the letter a local HTTP tool returns at random.

The tiny model first gets a short supervised warm-up (`warm_model`) that leaves the answer to ``key:`` at
chance (1/12); GSPO then trains two-turn episodes (call ``{f}``, read the letter, answer it); the reward is 1
when the answer is exactly the tool's letter. Usage: ``python -m bench.agents_tool_task [transformers|vllm]
[steps] [learning_rate] [--prompts P] [--group-size G] [--warmup copy|format] [--verbose]`` (``--verbose``:
a line of metrics per step, one group's episodes every 25 steps). docs/agents.md has the measured curves.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from gspo_core.agents.render import tool_turn_ids
from gspo_core.callbacks import Callbacks
from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.platform import RuntimeOptions
from gspo_core.policy import load_policy
from gspo_core.rewards import GraderPolicy
from gspo_core.toy import build_tiny_model
from gspo_core.trainer import train

LETTERS = "ABCDEFGHIJKL"
GRADE = (
    "def grade(s, i):\n    tools = [m['content'] for m in s['messages'] if m['role'] == 'tool']\n"
    "    return float(bool(tools) and s['output_text'].strip() == tools[-1])\n"
)


def tool_server(seed: int = 0) -> ThreadingHTTPServer:
    rng = random.Random(seed)

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


def warm_model(out: Path, copies: bool, steps: int = 300, lr: float = 2e-3, seed: int = 0) -> Path:
    """The tiny model after a short supervised warm-up (environment ids not trained, as in GSPO's loss):
    after ``key:`` call ``{f}``, then, after the tool's result, answer one of the letters and stop.

    The answer to ``key:`` is trained against the uniform distribution over the letters (the expected loss
    of random answer letters, without their noise): its start reward is chance. With ``copies``, half the
    rows are another prompt, ``cpy:``, whose answer is the tool's letter: the model can copy a tool's
    result (as a pretrained model can), but was shown not to after ``key:``; GSPO has to find that copying
    pays there too. Why not random answer letters at lr 1e-2 (this bench's first warm-up): they taught the
    answer position to ignore the result -- its hidden state was the same for all 12 results to 3e-7
    (docs/agents.md, "Measured")."""
    shutil.copytree(build_tiny_model(out.parent / "tiny"), out, dirs_exist_ok=True)
    torch.manual_seed(seed)
    model, tok = load_policy(str(out), GSPOConfig(), torch.device("cpu"))
    key, echo = (tok(p, add_special_tokens=False)["input_ids"] for p in ("key:", "cpy:"))  # same length
    call = tok("{f}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    letters_L = torch.tensor(tok(list(LETTERS), add_special_tokens=False)["input_ids"]).squeeze(-1)
    rng, opt = random.Random(seed + 1), torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        rows, values = [], []
        for i in range(32):
            value = rng.choice(LETTERS)
            env = tool_turn_ids(tok, [{"role": "tool", "content": value}], tok.eos_token)
            value_id = tok.convert_tokens_to_ids(value)
            rows.append((echo if copies and i % 2 else key) + call + env + [value_id, tok.eos_token_id])
            values.append(value_id if copies and i % 2 else -1)
        ids_BL = torch.tensor(rows)  # one length: no padding
        logp_BLV = model(input_ids=ids_BL).logits.float().log_softmax(-1)
        logp_BL = logp_BLV[:, :-1].gather(-1, ids_BL[:, 1:].unsqueeze(-1)).squeeze(-1)
        answer = ids_BL.size(1) - 2  # the answer letter's position; the call's tokens and the final EOS are exact
        exact = [*range(len(key) - 1, len(key) - 1 + len(call)), answer]
        # key: cross-entropy against uniform over the letters; cpy: the tool's letter.
        any_letter_B = logp_BLV[:, answer - 1, letters_L].mean(-1)
        copy_B = torch.tensor(values) >= 0
        answer_B = torch.where(copy_B, logp_BL[:, answer - 1], any_letter_B)
        loss = -(logp_BL[:, exact].sum(-1) + answer_B).mean() / (len(exact) + 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


class Curve(Callbacks):
    """Per-step reward and tool calls; with ``verbose`` a line per step and one group's episodes now and then."""

    def __init__(self, verbose: bool = False) -> None:
        self.reward: list[float] = []
        self.calls: list[float] = []
        self.elapsed: list[float] = []  # seconds from the first step's start to each step's end
        self.start = time.time()
        self.verbose = verbose

    def on_step(self, step, metrics):
        self.reward.append(metrics["reward/mean"])
        self.calls.append(metrics.get("tool_calls/mean", 0.0))
        if not self.elapsed:
            self.start = time.time() - metrics["time/step"]
        self.elapsed.append(time.time() - self.start)
        if self.verbose:
            keys = ("reward/mean", "tool_calls/mean", "reward/frac_zero_std", "grad_norm", "entropy", "ratio/max")
            keys += ("logprob_gap/max", "completion/len_mean", "time/step")
            print(step, " ".join(f"{k}={metrics[k]:.3g}" for k in keys if k in metrics), flush=True)

    def on_samples(self, step, rows):
        if self.verbose and (step <= 1 or step % 25 == 0):
            for c in rows[0]["completions"]:
                turns = [m.get("content") for m in c.get("messages", [])]
                print(f"  step {step} reward {c['reward']:.0f} {turns or c['text']!r}", flush=True)


def job(args: argparse.Namespace, work: Path, url: str) -> JobSpec:
    """The GSPO job: two-turn episodes of ``key:`` with the tool ``f`` at ``url``, one mini-batch a step."""
    data = work / "rows.jsonl"
    data.write_text('{"prompt": "key:"}\n' * 64)
    return JobSpec(
        model=str(warm_model(work / "model", args.warmup == "copy", seed=args.seed)),
        training_file=str(data),
        output_dir=str(work / "out"),
        reward={"type": "python", "source": GRADE},
        tools=[
            {
                "type": "http",
                "name": "f",
                "description": "a letter",
                "parameters": {"type": "object", "properties": {}},
                "server_url": url,
            }
        ],
        hyperparameters={
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "group_size": args.group_size,
            "max_turns": 2,
            "max_turn_tokens": 6,
            "max_new_tokens": 32,
            "learning_rate": args.learning_rate,
            "mini_batches": 1,
            "tool_format": "toy",
            "seed": args.seed,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", nargs="?", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("steps", nargs="?", type=int, default=60)
    parser.add_argument("learning_rate", nargs="?", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", choices=["copy", "format"], default="copy")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    server, work = tool_server(args.seed), Path(tempfile.mkdtemp(prefix="agents-bench-"))
    start = time.time()
    spec = job(args, work, f"http://127.0.0.1:{server.server_address[1]}/f")
    warmup_s = time.time() - start
    policy = GraderPolicy(python=os.environ.get("GSPO_GRADER_PYTHON"), egress_allow=("127.0.0.1",))
    curve = Curve(args.verbose)
    train(spec, curve, grader_policy=policy, runtime=RuntimeOptions(rollout_engine=args.engine))
    steps, every = len(curve.reward), max(1, len(curve.reward) // 15)
    print(
        json.dumps(
            {
                "engine": args.engine,
                "warmup_s": round(warmup_s, 1),
                "wall_s": round(time.time() - start - warmup_s, 1),
                "start_reward": round(sum(curve.reward[:5]) / 5, 3),
                "first_step_over_half": next((i + 1 for i, r in enumerate(curve.reward) if r > 0.5), None),
                "s_to_first_step_over_half": next(
                    (round(t, 1) for r, t in zip(curve.reward, curve.elapsed, strict=True) if r > 0.5), None
                ),
                f"reward_per_{every}_steps": [
                    round(sum(curve.reward[i : i + every]) / every, 3) for i in range(0, steps, every)
                ],
                "tool_calls": [round(sum(curve.calls[i : i + every]) / every, 2) for i in range(0, steps, every)],
            }
        )
    )
    server.shutdown()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
