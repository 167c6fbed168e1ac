"""The policy's log-probs are the model's own distribution: logit post-processing, dropout, LoRA export."""

from __future__ import annotations

import pytest
import torch

from gspo_core.config import GSPOConfig
from gspo_core.packing import pack, pack_shared
from gspo_core.policy import (
    check_logit_head,
    completion_logprobs,
    export_weights,
    load_policy,
    one_tied_gradient,
)
from gspo_core.toy import build_tokenizer
from tests.core.trainer_support import one_torch_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


_SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _save(tmp_path, family: str, **extra):
    """A tiny random model of ``family`` (saved with the toy tokenizer) whose forward post-processes logits."""
    import transformers

    tok = build_tokenizer(tmp_path)
    config_cls, model_cls = {
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "cohere": ("CohereConfig", "CohereForCausalLM"),
        "granite": ("GraniteConfig", "GraniteForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
    }[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **_SMALL, **extra)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # logits of a few units, where soft-capping and scaling change the distribution
        model.get_output_embeddings().weight.mul_(30.0)
    model.save_pretrained(tmp_path)
    return tmp_path, tok


def _rows():
    prompts = [[7, 8, 9], [7, 8, 9], [10, 11, 12, 13, 14]]
    comps = [[20, 21, 22, 23], [24, 25], [26, 27, 28]]
    return prompts, comps


def _model_logprobs(model, prompts, comps, temperature):
    """Reference: the model's own forward, one row at a time."""
    out = torch.zeros(len(prompts), max(map(len, comps)))
    with torch.no_grad():
        for b, (p, c) in enumerate(zip(prompts, comps, strict=True)):
            lp = (model(input_ids=torch.tensor([p + c])).logits[0].float() / temperature).log_softmax(-1)
            out[b, : len(c)] = lp[len(p) - 1 : len(p) + len(c) - 1].gather(1, torch.tensor(c)[:, None])[:, 0]
    return out


@pytest.mark.parametrize(
    "family,extra",
    [
        ("gemma2", {"final_logit_softcapping": 3.0, "head_dim": 16}),
        ("cohere", {"logit_scale": 0.25}),
        ("granite", {"logits_scaling": 8.0}),
    ],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_follow_the_model_familys_logit_postprocessing(tmp_path, family, extra, temperature):
    model_dir, tok = _save(tmp_path, family, **extra)
    model, _ = load_policy(str(model_dir), GSPOConfig(), torch.device("cpu"))  # check_logit_head passes
    prompts, comps = _rows()
    want = _model_logprobs(model, prompts, comps, temperature)
    for batch in (pack(prompts, comps, tok.pad_token_id), pack_shared(prompts, comps, tok.pad_token_id)):
        got = completion_logprobs(model, batch, temperature).detach()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the plain formula without the family's step is far off: the test can see the difference
    trunk, head = model.get_decoder(), model.get_output_embeddings()
    with torch.no_grad():
        raw = head(trunk(input_ids=torch.tensor([prompts[0] + comps[0]])).last_hidden_state)[0] / temperature
    raw_lp = raw.log_softmax(-1)[2:6].gather(1, torch.tensor(comps[0])[:, None])[:, 0]
    assert (raw_lp - want[0, :4]).abs().max() > 1e-2


def test_an_unknown_logit_postprocessing_is_refused(tmp_path):
    model_dir, _ = _save(tmp_path, "llama")
    model, _ = load_policy(str(model_dir), GSPOConfig(), torch.device("cpu"))
    model.config.final_logit_softcapping = 2.0  # Llama's forward ignores it, so ours would not match
    with pytest.raises(ValueError, match="post-processes the LM head's logits"):
        check_logit_head(model)


def test_dropout_is_off_in_training_mode(tmp_path):
    """Two forwards at the same weights give the same log-probs, though the config asks for dropout."""
    model_dir, tok = _save(tmp_path, "llama", attention_dropout=0.5)
    model, _ = load_policy(str(model_dir), GSPOConfig(lora_rank=4), torch.device("cpu"))
    assert model.training and model.config.attention_dropout == 0.5  # the saved config keeps its rate
    prompts, comps = _rows()
    batch = pack(prompts, comps, tok.pad_token_id)
    torch.testing.assert_close(
        completion_logprobs(model, batch, 1.0), completion_logprobs(model, batch, 1.0), atol=0, rtol=0
    )


@pytest.mark.parametrize(
    "family,extra",
    [
        ("llama", {"tie_word_embeddings": True}),  # the head's fused backward adds into .grad
        ("gemma2", {"final_logit_softcapping": 3.0, "head_dim": 16}),  # tied; a soft-capped head runs as a module
    ],
)
def test_a_tied_weights_one_gradient_buffer_gives_the_same_gradients(tmp_path, family, extra):
    """Two micro-batches' gradients, with the tied embedding's made sparse and the head's added into .grad,
    equal autograd's dense sum of the two (up to fp32 rounding): every parameter, and the tied one dense."""
    model_dir, tok = _save(tmp_path, family, **extra)
    prompts, comps = _rows()
    grads = []
    for one in (False, True):
        model, _ = load_policy(str(model_dir), GSPOConfig(), torch.device("cpu"))
        if one:
            assert one_tied_gradient(model)
        for rows in (slice(0, 2), slice(2, 3)):
            batch = pack_shared(prompts[rows], comps[rows], tok.pad_token_id)
            logp_BT = completion_logprobs(model, batch, 0.7)
            (logp_BT * torch.linspace(-1.0, 1.0, logp_BT.numel()).view_as(logp_BT)).sum().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    dense, one_buffer = grads
    tied = model.get_input_embeddings().weight.grad
    assert tied is not None and tied.layout == torch.strided and tied.abs().sum() > 0
    assert dense.keys() == one_buffer.keys()
    for name, grad in dense.items():
        torch.testing.assert_close(one_buffer[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_only_a_trained_tied_weight_gets_one_gradient_buffer(tmp_path):
    model_dir, _ = _save(tmp_path, "llama")  # head and embedding untied
    model, _ = load_policy(str(model_dir), GSPOConfig(), torch.device("cpu"))
    assert not one_tied_gradient(model) and not model.get_input_embeddings().sparse
    model_dir, _ = _save(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model, _ = load_policy(str(model_dir), GSPOConfig(lora_rank=4), torch.device("cpu"))  # frozen under LoRA
    assert not one_tied_gradient(model) and not model.get_input_embeddings().sparse


def test_lora_dropout_is_refused_by_name():
    with pytest.raises(ValueError, match="lora_dropout"):
        GSPOConfig(lora_rank=4, lora_dropout=0.05)


def test_rollout_old_logprobs_with_top_p_is_refused():
    with pytest.raises(ValueError, match="old_logprobs='rollout' needs top_p == 1"):
        GSPOConfig(old_logprobs="rollout", top_p=0.9)
    GSPOConfig(old_logprobs="auto", top_p=0.9)


def test_lora_export_is_base_plus_delta_and_leaves_the_base_untouched(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir), GSPOConfig(lora_rank=4), torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    base_before = {n: t.clone() for n, t in model.get_base_model().state_dict().items() if "lora_" not in n}
    exported = {n: t.clone() for n, t in export_weights(model)}
    for _ in range(3):  # pushes after every step must not move the frozen weights, not even by rounding
        for _ in export_weights(model):
            pass
    base_after = {n: t for n, t in model.get_base_model().state_dict().items() if "lora_" not in n}
    assert all(torch.equal(base_after[n], base_before[n]) for n in base_before)
    merged = model.merge_and_unload().state_dict()
    assert exported.keys() == merged.keys()
    q = next(n for n in exported if n.endswith("q_proj.weight"))
    assert not torch.equal(exported[q], base_before[q.replace("q_proj.", "q_proj.base_layer.")])
    for name, tensor in merged.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-6, rtol=1e-6, msg=name)


def test_an_export_past_the_shard_size_is_split_and_loads_whole(tiny_model_dir, tmp_path, monkeypatch):
    """An export is written in files of at most `EXPORT_SHARD_SIZE` (safetensors copies a file's GPU tensors to
    host memory at once): split, it loads whole in transformers and in a resume."""
    from transformers import AutoModelForCausalLM

    import gspo_core.policy
    from gspo_core.checkpoint import _saved_weights

    model, tokenizer = load_policy(str(tiny_model_dir), GSPOConfig(), torch.device("cpu"))
    monkeypatch.setattr(gspo_core.policy, "EXPORT_SHARD_SIZE", "100KB")  # the toy's 0.4 MB in several files
    gspo_core.policy.save_hf(model, tokenizer, tmp_path / "model")
    assert len(list((tmp_path / "model").glob("*.safetensors"))) > 1
    want = model.state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[name], want[name]) for name in want)
    assert all(torch.equal(tensor, want[name]) for name, tensor in _saved_weights(tmp_path).items())
