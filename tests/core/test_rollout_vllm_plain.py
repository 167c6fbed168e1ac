"""A vLLM engine built for plain sampling (T = 1, top-p = 1) reads raw logprobs, which are then the
sampled distribution's: they still match the trainer's, and other sampling settings are refused (greedy
decoding, which asks for no logprobs, is not)."""

from __future__ import annotations

import pytest
import torch

from gspo_core.config import GSPOConfig
from gspo_core.policy import load_policy
from gspo_core.rollout import SamplingSpec, make_engine, vllm_available
from tests.core.test_rollout_hf import assert_greedy, reference_logprobs


def test_plain_sampling_engine(tiny_model_dir):
    if not vllm_available():
        pytest.skip("vllm not installed")
    model, tok = load_policy(str(tiny_model_dir), GSPOConfig(), torch.device("cpu"))
    eng = make_engine(
        "vllm",
        model_dir=str(tiny_model_dir),
        policy=model,
        tokenizer=tok,
        seed=0,
        max_model_len=128,
        plain_sampling=True,
    )
    try:
        prompts = [tok("say a:")["input_ids"], tok("say bb, then c:")["input_ids"]]
        groups = eng.generate(prompts, SamplingSpec(n=4, max_tokens=12, ignore_eos=True, seed=3))
        for g, prompt in zip(groups, prompts, strict=True):
            assert len({tuple(c.completion_ids) for c in g}) > 1
            for c in g:
                ref = reference_logprobs(model, prompt, c.completion_ids)
                assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
        with pytest.raises(ValueError, match="plain sampling"):
            eng.generate(prompts, SamplingSpec(n=2, max_tokens=4, temperature=0.7))
        # Greedy completions (an evaluation's) ask for no logprobs: any engine decodes them, whatever T and top-p.
        assert_greedy(eng, model, prompts)
    finally:
        eng.close()
