"""The GEMM bound: every product raced computes ``x @ w.T``, the bound counts the model's products
(the prompt once, the LM head only at its last token), and a real engine stays under it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import gemm_bound as gb
from bench.gemm_bound import _products, gemm_bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_product_raced_is_x_times_w_transposed(dtype):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=g).to(dtype), torch.randn(5, 32, generator=g).to(dtype)
    want = x.float() @ w.float().T
    products = _products(w)
    # torch's linear everywhere; oneDNN's fp32 linear on every CPU wheel; vLLM's where it builds for the dtype
    assert len(products) >= (2 if dtype == torch.float32 else 1)
    for product in products:
        torch.testing.assert_close(
            product(x).float(),
            want,
            atol=0.05 if dtype == torch.bfloat16 else 1e-5,
            rtol=0.02 if dtype == torch.bfloat16 else 1e-5,
        )


def test_the_bound_counts_the_models_products(tiny_model_dir):
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    h, inter, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    body = layers * (h * h * 2 + h * kv * 2 + 3 * h * inter)  # q, o; k, v; gate, up, down
    head = vocab * h
    prompts, group, tokens = [17, 18, 20], 4, 8
    seqs = len(prompts) * group
    out = gemm_bound(AutoModelForCausalLM.from_pretrained(tiny_model_dir), prompts, group, tokens, reps=2)
    # Each prompt's tokens once through the body, the head once per prompt, then tokens - 1 decode steps.
    flops = 2 * (body * (sum(prompts) + seqs * (tokens - 1)) + head * (len(prompts) + seqs * (tokens - 1)))
    seconds = seqs * tokens / out["gemm_bound_tokens_per_s"]
    assert out["gemm_gflops"] * 1e9 * seconds == pytest.approx(flops, rel=1e-9)
    assert seconds == pytest.approx(out["gemm_prefill_s"] + (tokens - 1) * out["gemm_decode_step_s"])


def test_the_block_shared_bound_prefills_each_samples_partial_block(tiny_model_dir, monkeypatch):
    # Seconds proportional to the FLOPs asked for, so the accounting can be checked exactly.
    monkeypatch.setattr(gb, "_fastest", lambda weights, m, reps: 1e-12 * m * sum(w.numel() for w in weights))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head = model.lm_head.weight.numel()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - head
    prompts, group, tokens = [17, 18, 20, 32], 4, 8
    seqs, decode = len(prompts) * group, 1e-12 * len(prompts) * group * (body + head)
    out = gemm_bound(model, prompts, group, tokens, kv_block=16)
    # Per sample: the 1, 2, 4 tokens after the last whole block, and all 16 of the 32-token prompt's
    # last block (vLLM caps a prompt's cache hit at p - 1 tokens, so that block is computed again).
    private = 1 + 2 + 4 + 16
    want_s = 1e-12 * (body * (sum(prompts) + private * (group - 1)) + head * seqs) + (tokens - 1) * decode
    assert out["gemm_bound_block_shared_tokens_per_s"] == pytest.approx(seqs * tokens / want_s)
    shared_s = 1e-12 * (body * sum(prompts) + head * len(prompts)) + (tokens - 1) * decode
    assert out["gemm_bound_tokens_per_s"] == pytest.approx(seqs * tokens / shared_s)
    # Blocks as long as the longest prompt share nothing: every sample prefills its whole prompt.
    alone = gemm_bound(model, prompts, group, tokens, kv_block=32)["gemm_bound_block_shared_tokens_per_s"]
    assert alone == pytest.approx(
        seqs * tokens / (1e-12 * (body * sum(prompts) * group + head * seqs) + (tokens - 1) * decode)
    )
