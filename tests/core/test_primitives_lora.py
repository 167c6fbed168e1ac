"""LoRA on the parts Tinker's LoraConfig names (attention, MLP, unembedding): every part's adapter trains and the
sampler takes it; a head tied to the input embeddings gets none, so the sampler still scores as the trainer."""

from __future__ import annotations

import logging

import pytest
import torch

from gspo_core.primitives import AdamParams, Datum, LoraSpec, SamplingSession, TrainingSession
from gspo_core.primitives.types import ATTENTION_MODULES, MLP_MODULES
from tests.core.trainer_support import one_torch_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir, tmp_path_factory):
    """The toy model with its LM head tied to its input embeddings (as SmolLM2's is)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tied") / "toy-tied"
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def _datum(tokenizer) -> Datum:
    ids = tokenizer("say c:cccc", add_special_tokens=False)["input_ids"]
    return Datum(tokens=ids[:-1], target_tokens=ids[1:], weights=[0.0] * 5 + [1.0] * 4)


def _adapted(session: TrainingSession) -> set[str]:
    """The module names (their last part) that carry a LoRA adapter."""
    names = [n for n, p in session.policy.model.named_parameters() if p.requires_grad]
    return {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names}


def _train_and_push(model_dir, spec: LoraSpec) -> tuple[TrainingSession, list[float], list[float]]:
    """Three cross-entropy steps, then the trainer's and the pushed sampler's log-probs of the row."""
    session = TrainingSession.create(str(model_dir), lora=spec, device="cpu")
    datum = _datum(session.tokenizer)
    for _ in range(3):
        session.forward_backward([datum], "cross_entropy")
        session.optim_step(AdamParams(learning_rate=3e-2))
    sampler = SamplingSession.create(str(model_dir), engine="transformers")
    try:
        sampler.take_weights(session)
        pushed = sampler.compute_logprobs(datum.tokens + datum.target_tokens[-1:])[1:]
    finally:
        sampler.close()
    return session, session.forward([datum], "cross_entropy").logprobs[0], [float(x) for x in pushed]


def test_tinker_parts_adapt_attention_mlp_and_unembedding_and_the_sampler_takes_them(tiny_model_dir):
    session, trained, pushed = _train_and_push(tiny_model_dir, LoraSpec.of_parts(4))
    assert _adapted(session) == {*ATTENTION_MODULES, *MLP_MODULES, "lm_head"}
    # every part's adapter trained (LoRA's B starts at 0), the head's too: its logits are LoRA-wrapped
    for name, param in session.policy.model.named_parameters():
        if "lora_B" in name:
            assert param.abs().max() > 0, name
    torch.testing.assert_close(torch.tensor(pushed), torch.tensor(trained), atol=1e-5, rtol=0)
    assert sum(trained[-4:]) > -4 * 3.0  # "cccc" learnt from ~-4.6 a token at the start
    assert _adapted(TrainingSession.create(str(tiny_model_dir), lora=LoraSpec.of_parts(4, mlp=False))) == {
        *ATTENTION_MODULES,
        "lm_head",
    }
    with pytest.raises(ValueError, match="nothing to adapt"):
        LoraSpec.of_parts(4, attention=False, mlp=False, unembed=False)


def test_a_tied_head_gets_no_adapter_and_the_sampler_scores_as_the_trainer(tied_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="gspo_core.policy"):
        session, trained, pushed = _train_and_push(tied_model_dir, LoraSpec.of_parts(4))
    assert _adapted(session) == {*ATTENTION_MODULES, *MLP_MODULES}
    assert "lm_head is tied to the input embeddings" in caplog.text
    torch.testing.assert_close(torch.tensor(pushed), torch.tensor(trained), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="only the tied LM head"):
        TrainingSession.create(str(tied_model_dir), lora=LoraSpec.of_parts(4, attention=False, mlp=False))
