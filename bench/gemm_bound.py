"""The GEMM bound of a rollout: the completion tokens/s an engine would reach doing nothing but the model's
matrix products, timed on this machine at the rollout's own shapes.

Any sampling engine must at least run every ``nn.Linear`` of the model (the LM head included) once per
decoded token and once per prompt token (the prompt once per prompt: its G samples can share it; only the
last prompt token needs the LM head). :func:`gemm_bound` times exactly those products, each weight by the
fastest product this process offers for it (torch's ``linear``: MKL, or oneDNN for bf16; oneDNN's fp32
``linear``; vLLM's prepacked oneDNN matmul where vLLM is installed), decode batched over every sequence of
the call as both engines batch it. The last two are private ops, called here only to measure: neither the
trainer nor the engines' own code calls them from this project. No attention,
norms, sampling or Python is counted, so no engine can beat the bound; the bound over an engine's
tokens/s is the most any engine could gain over it here.
"""

from __future__ import annotations

import statistics
import time

import torch

from gspo_core.platform.cpu import CPU_KV_BLOCK


def _vllm_onednn(w: torch.Tensor):
    """vLLM's CPU product (a oneDNN matmul on a weight it prepacked), or None where vLLM lacks it or oneDNN
    cannot build it for this weight's dtype on this CPU."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if w.device.type != "cpu" or not getattr(ops, "_supports_onednn", False):
        return None
    try:  # vLLM itself falls back to torch's linear where oneDNN has no primitive (bf16 on AVX2 CPUs)
        handler = ops.create_onednn_mm(w.t(), 32)
    except RuntimeError:
        return None
    return lambda x: ops.onednn_mm(handler, x, None)


def _onednn_linear(w: torch.Tensor):
    """oneDNN's fp32 ``linear`` (``x @ w.T``, a private torch op: measured, never used), or None without it."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return None if op is None else (lambda x: op(x, w, None, "none", [], ""))


def _products(w: torch.Tensor) -> list:
    """Every ``x -> x @ w.T`` this process offers: torch's ``linear``, oneDNN's fp32 ``linear``, vLLM's."""
    impls = [lambda x: torch.nn.functional.linear(x, w)]
    if onednn := _onednn_linear(w):
        impls.append(onednn)
    vllm_mm = _vllm_onednn(w)
    return impls + ([vllm_mm] if vllm_mm else [])


def _seconds(product, x: torch.Tensor, reps: int) -> float:
    """Median seconds of ``product(x)`` over ``reps`` calls, after one warm-up call."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    with torch.inference_mode():
        product(x)
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            product(x)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fastest(weights: list[torch.Tensor], m: int, reps: int) -> float:
    """Seconds of ``x[m, K] @ w.T`` over each of ``weights``, each by its fastest product here."""
    return (
        sum(
            min(_seconds(p, torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device), reps) for p in _products(w))
            for w in weights
        )
        if m
        else 0.0
    )


def gemm_bound(
    model: torch.nn.Module,
    prompt_lengths: list[int],
    group: int,
    tokens: int,
    dtype: torch.dtype = torch.float32,
    reps: int = 5,
    kv_block: int = CPU_KV_BLOCK,
) -> dict:
    """The GEMM-only completion tokens/s of sampling ``group`` x ``tokens`` tokens from each prompt.

    ``prompt_lengths``: one length per prompt. Returns ``{"gemm_bound_tokens_per_s", "gemm_decode_step_s"
    (one step of all ``len(prompt_lengths) * group`` sequences), "gemm_prefill_s" (each prompt once),
    "gemm_gflops", "gemm_bound_block_shared_tokens_per_s"}``. The last is the bound of an engine whose
    samples share only a prompt's whole KV blocks of ``kv_block`` tokens, as vLLM's prefix cache does: each
    sample prefills the rest of its prompt on its own (all of it where the prompt is under one block).
    """
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [m.weight.detach().to(dtype) for m in linears]
    body = [w for m, w in zip(linears, weights, strict=True) if m is not head]
    head_w = [w for m, w in zip(linears, weights, strict=True) if m is head]
    seqs, n_prompt = len(prompt_lengths) * group, sum(prompt_lengths)
    decode_s = _fastest(weights, seqs, reps)
    # The prefill's last position yields the first token; the other tokens - 1 are decode steps.
    prefill_s = _fastest(body, n_prompt, reps) + _fastest(head_w, len(prompt_lengths), reps)
    # vLLM caps a prompt's cache hit at p - 1 tokens (it needs the last one's logits), hence p - 1.
    private = sum(p - (p - 1) // kv_block * kv_block for p in prompt_lengths)
    blocked_s = _fastest(body, n_prompt + private * (group - 1), reps) + _fastest(head_w, seqs, reps)
    total_s = prefill_s + (tokens - 1) * decode_s
    flops = 2 * (
        sum(w.numel() for w in body) * (n_prompt + seqs * (tokens - 1))
        + sum(w.numel() for w in head_w) * (len(prompt_lengths) + seqs * (tokens - 1))
    )
    return {
        "gemm_bound_tokens_per_s": seqs * tokens / total_s,
        "gemm_decode_step_s": decode_s,
        "gemm_prefill_s": prefill_s,
        "gemm_gflops": flops / total_s / 1e9,
        "gemm_bound_block_shared_tokens_per_s": seqs * tokens / (blocked_s + (tokens - 1) * decode_s),
    }
