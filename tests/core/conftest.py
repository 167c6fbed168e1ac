"""Fixtures of the core tests: one real rollout of the tiny policy for the update tests."""

from __future__ import annotations

import pytest
import torch

from gspo_core.policy import load_policy
from gspo_core.rollout import SamplingSpec, make_engine
from tests.core.trainer_support import UPDATE_CFG, one_torch_thread


@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    """The tiny policy and one real rollout of it (transformers engine, sampler logprobs asked):
    ``(model, pad_id, completions, rewards_N)``."""
    with one_torch_thread():
        model, tok = load_policy(str(tiny_model_dir), UPDATE_CFG, torch.device("cpu"))
        eng = make_engine(
            "transformers", model_dir=str(tiny_model_dir), policy=model, tokenizer=tok, seed=0, max_model_len=64
        )
        ids = [tok(f"say {c}:", add_special_tokens=False)["input_ids"] for c in "abcd"]
        groups = eng.generate(
            ids, SamplingSpec(n=UPDATE_CFG.group_size, max_tokens=UPDATE_CFG.max_new_tokens, seed=0, logprobs=True)
        )
    comps = [c for g in groups for c in g]
    rewards_N = torch.rand(len(comps), generator=torch.Generator().manual_seed(0))
    return model, tok.pad_token_id, comps, rewards_N


@pytest.fixture(scope="session")
def caller_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model taught to call a tool, then answer (tests/core/agents_support.py)."""
    from tests.core.agents_support import tool_calling_model

    with one_torch_thread():
        return tool_calling_model(tiny_model_dir, tmp_path_factory.mktemp("caller"))


@pytest.fixture
def agent_server():
    """A real agent server written against the `openai` client (tests/core/agents_support.py)."""
    from tests.core.agents_support import AgentServer

    server = AgentServer()
    yield server
    server.close()
