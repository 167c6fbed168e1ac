"""Token log-probs (and entropy) from the LM head, a chunk of positions at a time, with their own backward.

``log_softmax`` + ``gather`` + an entropy over a ``[B, T, V]`` logits tensor make about a dozen
full passes over it in forward and backward (the division by the temperature, the log-softmax
output, its exp for the entropy, the gather's zero-filled gradient, the log-softmax backward...),
each one a trip to memory at 32k-150k vocabularies. Here each cache-sized block of positions does
all of its work while it is in cache and writes only ``[N]`` results; the backward makes the one
gradient it has to in one pass per block.

:func:`head_logprobs` also takes the LM head's matmul in: logits are made a chunk of positions at
a time past :data:`KEEP_LOGITS_ELEMENTS` (``[N, V]`` fp32 logits of 16 rows x 1k tokens at a 150k
vocabulary would be 10 GB, and their gradient as much again), and the backward runs the head's two
GEMMs only over positions whose log-prob has a nonzero gradient: padding, and every token of a
sequence GSPO clipped (its whole gradient is 0), cost nothing there. Same values and gradients up to
fp32 rounding (tests/core/test_token_logprobs.py checks both against the plain formula).
"""

from __future__ import annotations

import torch

#: Elements of one softmax block (positions x vocabulary): ~2 MiB of fp32, so a block's temporaries stay in cache.
BLOCK_ELEMENTS = 1 << 19
#: Elements of one chunk of logits the head's GEMMs make at once (512 MiB of fp32), past KEEP_LOGITS_ELEMENTS.
CHUNK_ELEMENTS = 1 << 27
#: Logits up to this many elements (1 GiB of fp32) are made at once and kept for the backward; more are made
#: a chunk at a time and made again in the backward (the head's forward GEMM twice: ~1/3 more head work,
#: for memory that does not grow with the mini-batch).
KEEP_LOGITS_ELEMENTS = 1 << 28


def _spans(n_positions: int, per: int) -> list[slice]:
    per = max(1, per)
    return [slice(i, min(i + per, n_positions)) for i in range(0, n_positions, per)]


def _blocks(n_positions: int, vocab: int) -> list[slice]:
    return _spans(n_positions, BLOCK_ELEMENTS // max(vocab, 1))


def _forward_blocks(z_NV, target_N, temperature: float, with_entropy: bool, logp_N, lse_N, ent_N) -> None:
    """Fill ``logp_N``, ``lse_N`` (log-sum-exp of ``z / t``) and, when asked, ``ent_N`` from ``z_NV``."""
    for s in _blocks(z_NV.size(0), z_NV.size(1)):
        x = z_NV[s] / temperature if temperature != 1.0 else z_NV[s]
        lp = x.log_softmax(-1)
        logp_N[s] = lp.gather(-1, target_N[s].unsqueeze(-1)).squeeze(-1)
        lse_N[s] = x.gather(-1, target_N[s].unsqueeze(-1)).squeeze(-1) - logp_N[s]
        if with_entropy:
            ent_N[s] = -(lp.exp() * lp).sum(-1)


def _grad_blocks_(z_NV, target_N, lse_N, g_N, temperature: float, out_NV, rows_N=None) -> None:
    """``out_NV = d(sum_n g_n logp_n) / dz`` = ``(onehot(target) - softmax(z / t)) * g / t`` (``out_NV`` may be
    ``z_NV``); with ``rows_N``, of the rows ``z_NV[rows_N]`` (gathered a block at a time)."""
    g_N = g_N / temperature
    for s in _blocks(out_NV.size(0), out_NV.size(1)):
        x = z_NV[s] if rows_N is None else z_NV.index_select(0, rows_N[s])
        x = x / temperature if temperature != 1.0 else x
        p = out_NV[s]
        torch.sub(x, lse_N[s].unsqueeze(-1), out=p).exp_().mul_(-g_N[s].unsqueeze(-1))
        p.scatter_add_(-1, target_N[s].unsqueeze(-1), g_N[s].unsqueeze(-1))


def _new_outputs(like, n: int, with_entropy: bool, dtype):
    """Empty ``logp_N``, ``lse_N`` and ``ent_N`` (size 0 without entropy) on ``like``'s device."""
    ent_N = like.new_zeros(n if with_entropy else 0, dtype=dtype)
    return like.new_empty(n, dtype=dtype), like.new_empty(n, dtype=dtype), ent_N


class _TokenLogprobs(torch.autograd.Function):
    """``z_NV`` (head outputs of ``N`` positions) -> ``logp_N``, ``entropy_N`` of softmax(z / temperature)."""

    @staticmethod
    def forward(ctx, z_NV: torch.Tensor, target_N: torch.Tensor, temperature: float, with_entropy: bool):
        logp_N, lse_N, ent_N = _new_outputs(z_NV, z_NV.size(0), with_entropy, z_NV.dtype)
        _forward_blocks(z_NV, target_N, temperature, with_entropy, logp_N, lse_N, ent_N)
        ctx.save_for_backward(z_NV, target_N, lse_N)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, grad_logp_N: torch.Tensor, _grad_ent):
        z_NV, target_N, lse_N = ctx.saved_tensors
        grad_NV = torch.empty_like(z_NV)  # built in place, block by block: one write of [N, V] in all
        _grad_blocks_(z_NV, target_N, lse_N, grad_logp_N, ctx.temperature, grad_NV)
        return grad_NV, None, None, None


def token_logprobs(
    z_NV: torch.Tensor, target_N: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(z_NV / temperature)[n, target_N[n]]`` ``[N]`` and, when asked, each position's
    entropy ``[N]`` (detached; an empty tensor otherwise). ``z_NV`` is fp32 head output ``[N, V]``."""
    return _TokenLogprobs.apply(z_NV, target_N, float(temperature), bool(with_entropy))


def _logit_dtype(w_VH) -> torch.dtype:
    return torch.promote_types(w_VH.dtype, torch.float32)


def _logits(h_CH, w_VH, b_V, dtype) -> torch.Tensor:
    """Logits ``[C, V]`` of the head's matmul run in ``dtype`` (bf16 where the trainer autocasts), in fp32
    (fp64 for an fp64 head)."""
    z = h_CH.to(dtype) @ w_VH.to(dtype).t()
    if b_V is not None:
        z += b_V.to(dtype)
    return z.to(_logit_dtype(w_VH))


class _HeadLogprobs(torch.autograd.Function):
    """``h_NH`` (the head's inputs at ``N`` positions), head ``w_VH`` / ``b_V`` -> ``logp_N``, ``entropy_N``."""

    @staticmethod
    def forward(ctx, h_NH, w_VH, b_V, target_N, temperature: float, with_entropy: bool, dtype):
        N, V = h_NH.size(0), w_VH.size(0)
        logp_N, lse_N, ent_N = _new_outputs(h_NH, N, with_entropy, _logit_dtype(w_VH))
        keep = N * V <= KEEP_LOGITS_ELEMENTS
        kept = []  # the logits, kept for the backward when they are few enough
        for s in [slice(0, N)] if keep else _spans(N, CHUNK_ELEMENTS // V):
            z_CV = _logits(h_NH[s], w_VH, b_V, dtype)
            _forward_blocks(z_CV, target_N[s], temperature, with_entropy, logp_N[s], lse_N[s], ent_N[s])
            if keep:
                kept.append(z_CV)
        ctx.save_for_backward(h_NH, w_VH, b_V, target_N, lse_N, *kept)
        ctx.temperature, ctx.dtype = temperature, dtype
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_ent):
        h_NH, w_VH, b_V, target_N, lse_N, *kept = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        live_L = grad_logp_N.nonzero().squeeze(-1)  # positions with a gradient; the rest add exactly 0
        grad_h = torch.zeros_like(h_NH) if need_h else None
        grad_w = grad_b = None  # the first chunk's product is the gradient, later ones add to it
        V = w_VH.size(0)
        w_dt = w_VH.to(ctx.dtype)
        for s in _spans(len(live_L), CHUNK_ELEMENTS // V):
            pos = live_L[s]
            if kept:  # gathered straight into the gradient buffer: one read and one write of the live rows
                z_CV = kept[0].new_empty(len(pos), V)
                _grad_blocks_(kept[0], target_N[pos], lse_N[pos], grad_logp_N[pos], ctx.temperature, z_CV, pos)
            else:
                z_CV = _logits(h_NH[pos], w_VH, b_V, ctx.dtype)
                _grad_blocks_(z_CV, target_N[pos], lse_N[pos], grad_logp_N[pos], ctx.temperature, z_CV)
            dz = z_CV.to(ctx.dtype)
            if need_h:
                grad_h[pos] = (dz @ w_dt).to(grad_h.dtype)
            if need_w:
                part = (dz.t() @ h_NH[pos].to(ctx.dtype)).to(w_VH.dtype)
                grad_w = part if grad_w is None else grad_w.add_(part)
            if need_b:
                part = z_CV.sum(0).to(b_V.dtype)
                grad_b = part if grad_b is None else grad_b.add_(part)
        if need_w and grad_w is None:  # no position had a gradient
            grad_w = torch.zeros_like(w_VH)
        if need_b and grad_b is None:
            grad_b = torch.zeros_like(b_V)
        return grad_h, grad_w, grad_b, None, None, None, None


def head_logprobs(
    h_NH: torch.Tensor,
    head: torch.nn.Linear,
    target_N: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`token_logprobs` of ``head(h_NH)`` (``h_NH`` ``[N, H]``), with the head's matmul in ``dtype``
    (default: the weight's) made a chunk at a time, and its backward only over positions whose
    log-prob gets a nonzero gradient."""
    return _HeadLogprobs.apply(
        h_NH, head.weight, head.bias, target_N, float(temperature), bool(with_entropy), dtype or head.weight.dtype
    )
