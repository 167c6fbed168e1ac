"""Prompt sharing in the trainer's forward: the same logprobs, entropy and gradients as plain rows."""

from __future__ import annotations

import random

import pytest
import torch

from gspo_core.config import GSPOConfig
from gspo_core.packing import SHARE_MIN_SAVED, PackedBatch, SharedPrefixBatch, pack, pack_rows, pack_shared
from gspo_core.policy import completion_logprobs, load_policy
from tests.core.trainer_support import one_torch_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _rows(vocab: int, seed: int = 0):
    """Three prompts of 3, 5 and 8 tokens with 1, 3 and 4 rows each, completions of 1..7 tokens, shuffled."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, vocab) for _ in range(n)] for n in (3, 5, 8)]
    rows = [
        (prompts[g], [rng.randrange(6, vocab) for _ in range(rng.randint(1, 7))])
        for g, k in enumerate((1, 3, 4))
        for _ in range(k)
    ]
    rng.shuffle(rows)
    return [p for p, _ in rows], [c for _, c in rows]


def _qwen2(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gspo_core.toy import build_tokenizer

    tok = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


def _mistral_sliding(tmp_path):
    """A sliding window (4) shorter than the rows: it masks by distance in the cache, which left-padded
    shared prompts keep equal to the real distance."""
    from transformers import MistralConfig, MistralForCausalLM

    from gspo_core.toy import build_tokenizer

    tok = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
        pad_token_id=tok.pad_token_id,
    )
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


def _logprobs_and_grads(model, batch, temperature, weights_BT):
    model.zero_grad(set_to_none=True)
    logp_BT, entropy = completion_logprobs(model, batch, temperature, with_entropy=True)
    (logp_BT * weights_BT).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp_BT.detach(), entropy, grads


@pytest.mark.parametrize(
    "arch,lora_rank,temperature",
    [("llama", 0, 1.0), ("llama", 0, 0.7), ("llama", 4, 1.0), ("qwen2", 0, 1.0), ("mistral_sliding", 0, 1.0)],
)
def test_shared_prompts_give_the_same_logprobs_and_gradients(tiny_model_dir, tmp_path, arch, lora_rank, temperature):
    model_dir = {"llama": lambda _: tiny_model_dir, "qwen2": _qwen2, "mistral_sliding": _mistral_sliding}[arch](
        tmp_path
    )
    model, tok = load_policy(str(model_dir), GSPOConfig(lora_rank=lora_rank), torch.device("cpu"))
    prompts, comps = _rows(len(tok))
    plain, shared = pack(prompts, comps, tok.pad_token_id), pack_shared(prompts, comps, tok.pad_token_id)
    assert shared.prompt_PL.shape[0] == 3 and torch.equal(plain.mask_BT, shared.mask_BT)
    weights_BT = torch.randn(plain.mask_BT.shape, generator=torch.Generator().manual_seed(1))
    lp_a, ent_a, g_a = _logprobs_and_grads(model, plain, temperature, weights_BT)
    lp_b, ent_b, g_b = _logprobs_and_grads(model, shared, temperature, weights_BT)
    torch.testing.assert_close(lp_b, lp_a, atol=2e-5, rtol=1e-5)
    assert (lp_a[plain.mask_BT == 0] == 0).all() and (lp_a[plain.mask_BT == 1] < 0).all()
    assert ent_b == pytest.approx(ent_a, rel=1e-5)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], atol=1e-5, rtol=1e-4, msg=name)
    with torch.inference_mode():  # the no-grad old-logprob pass takes the same path
        torch.testing.assert_close(completion_logprobs(model, shared, temperature), lp_a, atol=2e-5, rtol=1e-5)


def test_sharing_is_chosen_where_it_saves_tokens():
    p, c = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10]
    assert isinstance(pack_rows([p] * 8, [c] * 8, 0), SharedPrefixBatch)
    assert isinstance(pack_rows([p] * 8, [c] * 8, 0, share=False), PackedBatch)
    distinct = [[i, *p] for i in range(8)]
    assert isinstance(pack_rows(distinct, [c] * 8, 0), PackedBatch)  # nothing repeats
    long_c = [c * 200] * 2  # one repeat of an 8-token prompt beside 800 completion tokens
    assert SHARE_MIN_SAVED * (2 * 8 + 800) > 8 and isinstance(pack_rows([p, p], long_c, 0), PackedBatch)
    assert isinstance(pack_rows([p] * 8, [c] * 7 + [[]], 0), PackedBatch)  # an empty completion: plain rows


def test_a_training_step_is_the_same_with_and_without_sharing(tiny_model_dir, tmp_path, monkeypatch):
    from tests.core.trainer_support import Recorder, toy_spec, train

    calls: list[str] = []
    for cls in (SharedPrefixBatch, PackedBatch):
        real = cls.hidden_BTH
        monkeypatch.setattr(
            cls, "hidden_BTH", lambda self, trunk, real=real: calls.append(type(self).__name__) or real(self, trunk)
        )
    metrics, used = {}, {}
    for share in (True, False):
        rec, calls[:] = Recorder(), []
        train(
            toy_spec(tiny_model_dir, tmp_path / str(share), steps=1, share_prompts=share, old_logprobs="recompute"), rec
        )
        metrics[share], used[share] = rec.steps[0][1], set(calls)
    # toy prompts are ~10 tokens beside <= 4 completion tokens: every forward shares, or none
    assert used == {True: {"SharedPrefixBatch"}, False: {"PackedBatch"}}
    for name in ("loss", "grad_norm", "ratio/mean", "ratio/min", "entropy"):
        assert metrics[True][name] == pytest.approx(metrics[False][name], rel=1e-4, abs=1e-6), name


def test_environment_tokens_are_attended_but_never_trained(tiny_model_dir):
    """A multi-turn row (sampled ids, environment ids, sampled ids): the environment ids are inputs of the
    later tokens, their log-probs are exactly 0 and whatever weighs them moves no gradient; plain and
    shared-prompt batches agree."""
    model, tok = load_policy(str(tiny_model_dir), GSPOConfig(), torch.device("cpu"))
    prompts, comps = _rows(len(tok), seed=2)
    masks = [[int(t % 3 != 0) for t in range(len(c))] for c in comps]
    plain = pack(prompts, comps, tok.pad_token_id, masks)
    shared = pack_shared(prompts, comps, tok.pad_token_id, masks)
    env_BT = (plain.mask_BT == 0) & (pack(prompts, comps, tok.pad_token_id).mask_BT == 1)
    assert env_BT.any() and torch.equal(plain.mask_BT, shared.mask_BT)
    weights_BT = torch.randn(plain.mask_BT.shape, generator=torch.Generator().manual_seed(1))
    lp_a, ent_a, g_a = _logprobs_and_grads(model, plain, 1.0, weights_BT)
    lp_b, _, g_b = _logprobs_and_grads(model, shared, 1.0, weights_BT)
    _, ent_c, g_c = _logprobs_and_grads(model, plain, 1.0, weights_BT + 1e3 * env_BT)
    assert (lp_a[env_BT] == 0).all() and (lp_a[plain.mask_BT == 1] < 0).all()
    torch.testing.assert_close(lp_b, lp_a, atol=2e-5, rtol=1e-5)
    assert ent_c == ent_a
    for name in g_a:
        assert torch.equal(g_c[name], g_a[name]), name
        torch.testing.assert_close(g_b[name], g_a[name], atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="mask of 1"):
        pack(prompts[:1], [[7, 8]], tok.pad_token_id, [[1]])
