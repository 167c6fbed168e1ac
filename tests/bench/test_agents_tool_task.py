"""The agent bench's premise: its warm-up gives the skill of copying a tool's result, not the task's answer."""

from __future__ import annotations

import torch

from bench.agents_tool_task import LETTERS, warm_model
from gspo_core.agents.render import tool_turn_ids
from gspo_core.config import GSPOConfig
from gspo_core.packing import pack
from gspo_core.policy import completion_logprobs, load_policy


def test_warm_up_copies_after_cpy_and_leaves_key_at_chance(tmp_path):
    model, tok = load_policy(str(warm_model(tmp_path / "model", copies=True)), GSPOConfig(), torch.device("cpu"))
    call = [*tok("{f}", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    rows, masks = [], []
    for letter in LETTERS:  # each episode as GSPO would sample it, answering the tool's letter
        env = tool_turn_ids(tok, [{"role": "tool", "content": letter}], tok.eos_token)
        rows.append([*call, *env, tok.convert_tokens_to_ids(letter)])
        masks.append([1] * len(call) + [0] * len(env) + [1])
    p_copy, p_call = {}, {}
    for prompt in ("key:", "cpy:"):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        batch = pack([ids] * len(rows), rows, tok.pad_token_id, masks)
        with torch.inference_mode():
            logp_BT = completion_logprobs(model, batch, 1.0)
        p_call[prompt] = float(logp_BT[:, : len(call)].sum(-1).exp().mean())
        p_copy[prompt] = float(logp_BT[:, -1].exp().mean())
    assert p_call["key:"] > 0.9 and p_call["cpy:"] > 0.9
    # The task's start: the tool's letter is answered at chance (1/12), so GSPO's rise is its own work.
    assert abs(p_copy["key:"] - 1 / len(LETTERS)) < 0.02, p_copy
    assert p_copy["cpy:"] > 0.9, p_copy
