"""A tiny model taught (a few seconds of supervised steps) to call a tool in the toy format and then answer,
so that episode tests run real engines on real multi-turn trajectories."""

from __future__ import annotations

import shutil
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
