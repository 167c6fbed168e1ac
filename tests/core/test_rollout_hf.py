"""The transformers rollout engine, and the `make_engine` factory, on the toy model (CPU, fp32)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from gspo_core.config import GSPOConfig
from gspo_core.policy import load_policy
from gspo_core.rollout import SamplingSpec, make_engine, vllm_available
from gspo_core.rollout.hf_engine import TransformersEngine, top_p_mask

DEVICE = torch.device("cpu")


def reference_logprobs(model, prompt_ids, completion_ids, temperature=1.0, top_p=1.0) -> torch.Tensor:
    """Log-probs ``[T]`` of ``completion_ids`` under log_softmax(top_p_mask(logits / T)) from one
    plain forward of the whole sequence (no generate, no cache)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits_LV = model(input_ids=ids).logits[0].float()
    P, T = len(prompt_ids), len(completion_ids)
    scores_TV = top_p_mask(logits_LV[P - 1 : P + T - 1] / temperature, top_p)
    return scores_TV.log_softmax(-1).gather(1, torch.tensor(completion_ids).unsqueeze(1)).squeeze(1)


def greedy_path(model, prompt_ids, n_tokens) -> list[int]:
    """The argmax continuation of ``prompt_ids``, one plain forward per token (the reference greedy decode)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n_tokens):
            logits_V = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits_V.argmax()))
    return ids[len(prompt_ids) :]


def assert_greedy(engine, model, prompts) -> None:
    """Greedy completions are the argmax path whatever the temperature, top-p and seed."""
    for temperature, top_p, seed in ((1.0, 1.0, 1), (0.7, 0.9, 2)):
        spec = SamplingSpec(
            n=1, max_tokens=10, temperature=temperature, top_p=top_p, ignore_eos=True, seed=seed, logprobs=False
        )
        groups = engine.generate(prompts, replace(spec, greedy=True))
        for (completion,), prompt in zip(groups, prompts, strict=True):
            assert completion.completion_ids == greedy_path(model, prompt, 10)


def check_contract(groups, prompts, n, max_tokens, eos_id):
    """Group shapes, lengths, finish reasons and EOS placement of ``generate``'s answer."""
    assert len(groups) == len(prompts)
    for p, group in enumerate(groups):
        assert len(group) == n
        for c in group:
            assert c.prompt_index == p and c.prompt_ids == prompts[p]
            assert 1 <= len(c.completion_ids) <= max_tokens
            assert len(c.logprobs) == len(c.completion_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            if c.finish_reason == "stop":  # EOS kept as the last token, nowhere before it
                assert c.completion_ids[-1] == eos_id and eos_id not in c.completion_ids[:-1]
            else:
                assert c.finish_reason == "length" and len(c.completion_ids) == max_tokens
                assert eos_id not in c.completion_ids


def adapted_lora(tiny_model_dir):
    """A LoRA policy whose adapter changes the model (random ``lora_B``; PEFT starts it at 0)."""
    lora, _ = load_policy(str(tiny_model_dir), GSPOConfig(lora_rank=4), DEVICE)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return lora


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir), GSPOConfig(), DEVICE)


@pytest.fixture
def engine(policy, tiny_model_dir):
    model, tok = policy
    return make_engine(
        "transformers", model_dir=str(tiny_model_dir), policy=model, tokenizer=tok, seed=0, max_model_len=512
    )


@pytest.fixture(scope="module")
def prompts(policy):
    _, tok = policy
    return [tok("say a:")["input_ids"], tok("say bb, then c, then more:")["input_ids"]]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_contract_and_logprobs_match_a_plain_forward(engine, policy, prompts, temperature, top_p):
    model, tok = policy
    spec = SamplingSpec(n=8, max_tokens=40, temperature=temperature, top_p=top_p, seed=3)
    groups = engine.generate(prompts, spec)
    check_contract(groups, prompts, 8, 40, tok.eos_token_id)
    assert {c.finish_reason for g in groups for c in g} == {"stop", "length"}
    assert len({tuple(c.completion_ids) for c in groups[0]}) == 8, "the G samples of a prompt must differ"
    for c in groups[0] + groups[1]:
        ref = reference_logprobs(model, c.prompt_ids, c.completion_ids, temperature, top_p)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)
        assert c.text == tok.decode(c.completion_ids, skip_special_tokens=True)


def test_greedy_completions_are_the_argmax_path(engine, policy, prompts):
    assert_greedy(engine, policy[0], prompts)


def test_top_p_truncates_the_sampling_distribution(engine, policy, prompts):
    """With top_p < 1 no sampled token lies outside the nucleus, and the processed logprob is the
    temperature-scaled one renormalised over the nucleus (so it is higher, never lower)."""
    model, _ = policy
    groups = engine.generate(prompts, SamplingSpec(n=4, max_tokens=12, top_p=0.3, ignore_eos=True, seed=2))
    for c in groups[1]:
        full = reference_logprobs(model, c.prompt_ids, c.completion_ids, 1.0, 1.0)
        assert torch.isfinite(torch.tensor(c.logprobs)).all()
        assert (torch.tensor(c.logprobs) - full).min() > 0.1


def test_ignore_eos_samples_to_max_tokens_without_masking_eos(engine, prompts):
    groups = engine.generate(prompts, SamplingSpec(n=8, max_tokens=60, ignore_eos=True, seed=1))
    assert all(len(c.completion_ids) == 60 and c.finish_reason == "length" for g in groups for c in g)
    eos = engine.tokenizer.eos_token_id
    assert any(eos in c.completion_ids for g in groups for c in g), "EOS stays sampleable (as in vLLM)"


def test_seeds_reproduce_and_leave_global_rng_and_mode_alone(engine, policy, prompts):
    model, _ = policy
    model.train()
    rng_before = torch.get_rng_state()
    a = engine.generate(prompts, SamplingSpec(n=3, max_tokens=8, seed=5))
    b = engine.generate(prompts, SamplingSpec(n=3, max_tokens=8, seed=5))
    c = engine.generate(prompts, SamplingSpec(n=3, max_tokens=8, seed=6))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert model.training, "generate must restore train mode"
    ids = lambda groups: [x.completion_ids for g in groups for x in g]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_batches_split_and_keep_prompt_order(policy, prompts):
    model, tok = policy
    small = TransformersEngine(model, tok, seed=0, batch_size=3)
    groups = small.generate(prompts * 2, SamplingSpec(n=4, max_tokens=5, seed=0))
    check_contract(groups, prompts * 2, 4, 5, tok.eos_token_id)


def test_each_prompt_is_prefilled_once_for_its_group(engine, policy, prompts):
    """The G samples reuse one pass over their prompt: the model embeds each prompt's tokens once
    (all but the last; the first decode step runs that one per sample), then one token per sample and
    step -- not G copies of every prompt."""
    model, _ = policy
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        engine.generate(prompts, SamplingSpec(n=4, max_tokens=6, ignore_eos=True, seed=0))
    finally:
        hook.remove()
    width = max(map(len, prompts))
    assert seen == [len(prompts) * (width - 1)] + [len(prompts) * 4] * 6


def test_a_lora_policy_samples_with_its_adapter(policy, tiny_model_dir, prompts):
    """The shared prompt pass runs the adapted model (PEFT-wrapped): logprobs match its plain forward."""
    _, tok = policy
    lora = adapted_lora(tiny_model_dir)
    groups = TransformersEngine(lora, tok, seed=0).generate(prompts, SamplingSpec(n=3, max_tokens=8, seed=1))
    for c in groups[0] + groups[1]:
        ref = reference_logprobs(lora, c.prompt_ids, c.completion_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
        with lora.disable_adapter():
            assert (ref - reference_logprobs(lora, c.prompt_ids, c.completion_ids)).abs().max() > 1e-2


def test_shares_the_trainers_weights(engine, policy, prompts):
    """No copy: an in-place change of the policy is what the next rollout samples from."""
    model, _ = policy
    assert engine.shares_weights and engine.policy is model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.load_weights(model.state_dict().items())
        c = engine.generate(prompts[:1], SamplingSpec(n=1, max_tokens=6, ignore_eos=True, seed=0))[0][0]
        ref = reference_logprobs(model, c.prompt_ids, c.completion_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    finally:
        model.load_state_dict(saved)


def test_generation_config_defaults_of_the_model_do_not_leak(engine, policy, prompts):
    """A model whose generation_config asks for a strong repetition penalty still samples (and
    reports logprobs) from the plain distribution, as vLLM does with explicit sampling params."""
    model, _ = policy
    saved = model.generation_config.repetition_penalty
    model.generation_config.repetition_penalty = 5.0
    try:
        c = engine.generate(prompts[:1], SamplingSpec(n=2, max_tokens=10, ignore_eos=True, seed=0))[0][0]
    finally:
        model.generation_config.repetition_penalty = saved
    ref = reference_logprobs(model, c.prompt_ids, c.completion_ids)
    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.generate([[]], SamplingSpec(n=1, max_tokens=2))


def test_make_engine_names_the_bad_kind(policy, tiny_model_dir):
    model, tok = policy
    with pytest.raises(ValueError, match="unknown rollout engine 'bogus'"):
        make_engine("bogus", model_dir=str(tiny_model_dir), policy=model, tokenizer=tok, seed=0, max_model_len=64)
    if not vllm_available():
        with pytest.raises(RuntimeError, match="vLLM is not installed"):
            make_engine("vllm", model_dir=str(tiny_model_dir), policy=model, tokenizer=tok, seed=0, max_model_len=64)
        assert (
            make_engine(
                "auto", model_dir=str(tiny_model_dir), policy=model, tokenizer=tok, seed=0, max_model_len=64
            ).name
            == "transformers"
        )


def test_importing_the_package_does_not_import_vllm():
    code = "import sys, gspo_core.rollout; assert 'vllm' not in sys.modules, 'vllm imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def check_logprobs_only_when_asked(engine, prompts, max_tokens: int) -> None:
    """Without logprobs the same seeded samples come back (only the logprob output is skipped)."""
    spec = SamplingSpec(n=3, max_tokens=max_tokens, ignore_eos=True, seed=21)
    with_lp = engine.generate(prompts, spec)
    without = engine.generate(prompts, replace(spec, logprobs=False))
    for g_a, g_b in zip(with_lp, without, strict=True):
        for a, b in zip(g_a, g_b, strict=True):
            assert len(a.logprobs) == len(a.completion_ids) == max_tokens and b.logprobs == []
            assert a.completion_ids == b.completion_ids


def test_logprobs_only_when_asked(engine, prompts):
    check_logprobs_only_when_asked(engine, prompts, 6)


def bf16_reference_logprobs(model, prompt_ids, completion_ids) -> torch.Tensor:
    """`reference_logprobs` of one forward under bf16 autocast (a bf16 trainer's forward)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return reference_logprobs(model, prompt_ids, completion_ids)


def test_a_bfloat16_sampler_computes_under_autocast_on_fp32_weights(policy, tiny_model_dir, prompts):
    """dtype="bfloat16": every forward of the rollout (shared prompt pass included) runs bf16 products,
    its logprobs are a bf16 forward's (off the fp32 ones by bf16's rounding), the weights stay fp32."""
    model, tok = policy
    eng = make_engine(
        "transformers",
        model_dir=str(tiny_model_dir),
        policy=model,
        tokenizer=tok,
        seed=0,
        max_model_len=64,
        dtype="bfloat16",
    )
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    try:
        groups = eng.generate(prompts, SamplingSpec(n=2, max_tokens=6, ignore_eos=True, seed=0))
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for c in groups[0] + groups[1]:
        got = torch.tensor(c.logprobs)
        fp32_gap = (got - reference_logprobs(model, c.prompt_ids, c.completion_ids)).abs().max()
        bf16_gap = (got - bf16_reference_logprobs(model, c.prompt_ids, c.completion_ids)).abs().max()
        assert 1e-4 < fp32_gap < 0.1 and bf16_gap < fp32_gap


def test_an_unknown_sampler_dtype_is_named(policy):
    model, tok = policy
    with pytest.raises(ValueError, match="dtype: 'float16' is not one of float32, bfloat16"):
        TransformersEngine(model, tok, dtype="float16")
