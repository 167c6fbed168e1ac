"""The vLLM engine in bf16 (a bf16 trainer's sampler): bf16 weights, bf16-close logprobs, fp32 pushes."""

from __future__ import annotations

import pytest
import torch

from gspo_core.config import GSPOConfig
from gspo_core.policy import export_weights, load_policy
from gspo_core.rollout import SamplingSpec, make_engine, vllm_available
from tests.core.test_rollout_hf import bf16_reference_logprobs, reference_logprobs
from tests.core.test_rollout_vllm import perturbed

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(str(tiny_model_dir), GSPOConfig(), torch.device("cpu"))


@pytest.fixture(scope="module", params=[None, 8], ids=["long-completions", "short-completions"])
def engine(request, tiny_model_dir, policy):
    """Built for completions of unknown length and of at most 8 tokens (16-token KV blocks where bf16
    runs "vec" at 32: `vllm_engine.cpu_kv_block`)."""
    if not vllm_available():
        pytest.skip("vllm not installed")
    from gspo_core.platform.cpu import cpu_kv_block

    model, tok = policy
    eng = make_engine(
        "vllm",
        model_dir=str(tiny_model_dir),
        policy=model,
        tokenizer=tok,
        seed=0,
        max_model_len=128,
        dtype="bfloat16",
        max_new_tokens=request.param,
    )
    assert eng.kv_block == cpu_kv_block(request.param, "bfloat16")
    yield eng
    eng.close()


def gap(c, model, reference=reference_logprobs) -> float:
    """Largest |logprob| gap of completion ``c`` to ``model``'s forward by ``reference`` (fp32 by default)."""
    return (torch.tensor(c.logprobs) - reference(model, c.prompt_ids, c.completion_ids)).abs().max().item()


def weight_dtypes(engine) -> set[torch.dtype]:
    return engine.llm.apply_model(lambda m: {p.dtype for p in m.parameters()})[0]


def test_weights_are_bf16_and_logprobs_a_bf16_forwards(engine, policy):
    """vLLM holds bf16 weights; its logprobs are off the fp32 forward's by bf16 rounding (not more)."""
    model, tok = policy
    assert weight_dtypes(engine) == {torch.bfloat16}
    groups = engine.generate(
        [tok("say a:")["input_ids"], tok("say bb, then c:")["input_ids"]],
        SamplingSpec(n=2, max_tokens=8, ignore_eos=True, seed=0, logprobs=True),
    )
    for c in groups[0] + groups[1]:
        assert 1e-4 < gap(c, model) < 0.1 and gap(c, model, bf16_reference_logprobs) < 0.1


def test_an_fp32_push_lands_cast_to_bf16(engine, policy, tiny_model_dir):
    """The trainer exports fp32 tensors: after the push the engine samples from the new weights
    (within bf16 rounding) and is far from the old ones; the weights stay bf16."""
    model, tok = policy
    new = perturbed(tiny_model_dir, scale=0.1)
    prompt = tok("say bb, then c:")["input_ids"]
    spec = SamplingSpec(n=1, max_tokens=8, ignore_eos=True, seed=3, logprobs=True)
    try:
        engine.load_weights(export_weights(new))
        c = engine.generate([prompt], spec)[0][0]
        to_new, to_old = gap(c, new), gap(c, model)
        assert to_new < 0.1 and to_old > 4 * to_new
        assert weight_dtypes(engine) == {torch.bfloat16}
    finally:
        engine.load_weights(export_weights(model))
