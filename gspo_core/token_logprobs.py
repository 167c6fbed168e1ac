"""Token log-probs (and entropy) from the LM head, a chunk of positions at a time, with their own backward.

``log_softmax`` + ``gather`` + an entropy over a ``[B, T, V]`` logits tensor make about a dozen
full passes over it in forward and backward (the division by the temperature, the log-softmax
output, its exp for the entropy, the gather's zero-filled gradient, the log-softmax backward...),
each one a trip to memory at 32k-150k vocabularies. Here each cache-sized block of positions does
all of its work while it is in cache and writes only ``[F]`` results (``F``: the positions, ``B * T``
flattened); the backward makes the one gradient it has to in one pass per block.

:func:`head_logprobs` also takes the LM head's matmul in: logits are made a chunk of positions at
a time past :data:`KEEP_LOGITS_ELEMENTS` (``[F, V]`` fp32 logits of 16 rows x 1k tokens at a 150k
vocabulary would be 10 GB, and their gradient as much again), and the backward runs the head's two
GEMMs only over positions whose log-prob has a nonzero gradient: padding, and every token of a
sequence GSPO clipped (its whole gradient is 0), cost nothing there. Same values and gradients up to
fp32 rounding (tests/core/test_token_logprobs.py checks both against the plain formula).
"""

from __future__ import annotations

import torch

#: Elements of one softmax block (positions x vocabulary): ~2 MiB of fp32, so a block's temporaries stay in a
#: CPU's cache.
BLOCK_ELEMENTS = 1 << 19
#: The same on a GPU, whose kernels want many positions at once (blocks of 3 positions at a 152k vocabulary made
#: thousands of launches a forward; docs/bench.md, GPU): as large as the largest chunk kept.
GPU_BLOCK_ELEMENTS = 1 << 28
#: Elements of one chunk of logits the head's GEMMs make at once (512 MiB of fp32), past KEEP_LOGITS_ELEMENTS.
CHUNK_ELEMENTS = 1 << 27
#: Logits up to this many elements (1 GiB of fp32) are made at once and kept for the backward; more are made
#: a chunk at a time and made again in the backward (the head's forward GEMM twice: ~1/3 more head work,
#: for memory that does not grow with the mini-batch).
KEEP_LOGITS_ELEMENTS = 1 << 28
#: Elements of one chunk of logits where nothing needs a gradient (old log-probs, evaluation): nothing is
#: kept, so a chunk of 64 MiB of fp32 is as fast as one GEMM over all positions (at a 49k vocabulary, 341
#: positions a chunk) and the no-grad pass's memory stays flat instead of rising to KEEP_LOGITS_ELEMENTS.
NO_GRAD_CHUNK_ELEMENTS = 1 << 24


def _spans(n_positions: int, per: int) -> list[slice]:
    per = max(1, per)
    return [slice(i, min(i + per, n_positions)) for i in range(0, n_positions, per)]


def _blocks(n_positions: int, vocab: int, device: torch.device) -> list[slice]:
    per = BLOCK_ELEMENTS if device.type == "cpu" else GPU_BLOCK_ELEMENTS
    return _spans(n_positions, per // max(vocab, 1))


def _forward_blocks(z_CV, target_C, temperature: float, with_entropy: bool, logp_C, lse_C, entropy_C) -> None:
    """Fill ``logp_C``, ``lse_C`` (log-sum-exp of ``z / t``) and, when asked, ``entropy_C`` from ``z_CV``."""
    for span in _blocks(z_CV.size(0), z_CV.size(1), z_CV.device):
        x = z_CV[span] / temperature if temperature != 1.0 else z_CV[span]
        logp = x.log_softmax(-1)
        logp_C[span] = logp.gather(-1, target_C[span].unsqueeze(-1)).squeeze(-1)
        lse_C[span] = x.gather(-1, target_C[span].unsqueeze(-1)).squeeze(-1) - logp_C[span]
        if with_entropy:
            entropy_C[span] = -(logp.exp() * logp).sum(-1)


def _grad_blocks_(z_FV, target_C, lse_C, grad_C, temperature: float, out_CV, positions_C=None) -> None:
    """``out_CV = d(sum_c grad_c logp_c) / dz`` = ``(onehot(target) - softmax(z / t)) * grad / t`` at the
    positions ``z_FV[positions_C]`` (gathered a block at a time; ``out_CV`` may be rows of ``z_FV`` at or before
    the ascending ``positions_C``); without ``positions_C``, at every position (``C = F``, and ``out_CV`` may be
    ``z_FV``)."""
    grad_C = grad_C / temperature
    for span in _blocks(out_CV.size(0), out_CV.size(1), out_CV.device):
        x = z_FV[span] if positions_C is None else z_FV.index_select(0, positions_C[span])
        x = x / temperature if temperature != 1.0 else x
        out = out_CV[span]
        torch.sub(x, lse_C[span].unsqueeze(-1), out=out).exp_().mul_(-grad_C[span].unsqueeze(-1))
        out.scatter_add_(-1, target_C[span].unsqueeze(-1), grad_C[span].unsqueeze(-1))


def _new_outputs(like, n: int, with_entropy: bool, dtype):
    """Empty ``logp_F``, ``lse_F`` and ``entropy_F`` (size 0 without entropy) on ``like``'s device."""
    entropy_F = like.new_zeros(n if with_entropy else 0, dtype=dtype)
    return like.new_empty(n, dtype=dtype), like.new_empty(n, dtype=dtype), entropy_F


class _TokenLogprobs(torch.autograd.Function):
    """``z_FV`` (head outputs of ``F`` positions) -> ``logp_F``, ``entropy_F`` of softmax(z / temperature)."""

    @staticmethod
    def forward(ctx, z_FV: torch.Tensor, target_F: torch.Tensor, temperature: float, with_entropy: bool):
        logp_F, lse_F, entropy_F = _new_outputs(z_FV, z_FV.size(0), with_entropy, z_FV.dtype)
        _forward_blocks(z_FV, target_F, temperature, with_entropy, logp_F, lse_F, entropy_F)
        ctx.save_for_backward(z_FV, target_F, lse_F)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy_F)
        return logp_F, entropy_F

    @staticmethod
    def backward(ctx, grad_logp_F: torch.Tensor, _grad_entropy):
        z_FV, target_F, lse_F = ctx.saved_tensors
        grad_FV = torch.empty_like(z_FV)  # built in place, block by block: one write of [F, V] in all
        _grad_blocks_(z_FV, target_F, lse_F, grad_logp_F, ctx.temperature, grad_FV)
        return grad_FV, None, None, None


def token_logprobs(
    z_FV: torch.Tensor, target_F: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(z_FV / temperature)[f, target_F[f]]`` ``[F]`` and, when asked, each position's
    entropy ``[F]`` (detached; an empty tensor otherwise). ``z_FV`` is fp32 head output ``[F, V]``."""
    return _TokenLogprobs.apply(z_FV, target_F, float(temperature), bool(with_entropy))


def _logit_dtype(w_VH) -> torch.dtype:
    return torch.promote_types(w_VH.dtype, torch.float32)


def _logits(h_CH, w_VH, b_V, dtype) -> torch.Tensor:
    """Logits ``[C, V]`` of the head's matmul run in ``dtype`` (bf16 where the trainer autocasts), in fp32
    (fp64 for an fp64 head)."""
    z_CV = h_CH.to(dtype) @ w_VH.to(dtype).t()
    if b_V is not None:
        z_CV += b_V.to(dtype)
    return z_CV.to(_logit_dtype(w_VH))


class _HeadLogprobs(torch.autograd.Function):
    """``h_FH`` (the head's inputs at ``F`` positions), head ``w_VH`` / ``b_V`` -> ``logp_F``, ``entropy_F``."""

    @staticmethod
    def forward(ctx, h_FH, w_VH, b_V, target_F, temperature: float, with_entropy: bool, dtype, into_grad: bool):
        F, V = h_FH.size(0), w_VH.size(0)
        logp_F, lse_F, entropy_F = _new_outputs(h_FH, F, with_entropy, _logit_dtype(w_VH))
        keep = F * V <= KEEP_LOGITS_ELEMENTS
        kept = []  # the logits, kept for the backward when they are few enough
        for span in [slice(0, F)] if keep else _spans(F, CHUNK_ELEMENTS // V):
            z_CV = _logits(h_FH[span], w_VH, b_V, dtype)
            _forward_blocks(z_CV, target_F[span], temperature, with_entropy, logp_F[span], lse_F[span], entropy_F[span])
            if keep:
                kept.append(z_CV)
        ctx.save_for_backward(h_FH, w_VH, b_V, target_F, lse_F, *kept)
        ctx.temperature, ctx.dtype, ctx.into_grad = temperature, dtype, into_grad
        ctx.mark_non_differentiable(entropy_F)
        return logp_F, entropy_F

    @staticmethod
    def backward(ctx, grad_logp_F, _grad_entropy):
        h_FH, w_VH, b_V, target_F, lse_F, *kept = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        live_C = grad_logp_F.nonzero().squeeze(-1)  # positions with a gradient; the rest add exactly 0
        grad_h_FH = torch.zeros_like(h_FH) if need_h else None
        into_w = need_w and ctx.into_grad  # the weight's gradient goes straight into its .grad (head_logprobs)
        # The first chunk's product is the gradient (or is added to the .grad it goes into), later ones add to it.
        grad_w_VH = w_VH.grad if into_w else None
        grad_b_V = None
        V = w_VH.size(0)
        w_cast_VH = w_VH.to(ctx.dtype)
        for span in _spans(len(live_C), CHUNK_ELEMENTS // V):
            positions = live_C[span]
            target_C, lse_C, grad_C = target_F[positions], lse_F[positions], grad_logp_F[positions]
            if kept:  # turned into their gradient in place, the live rows packed to the front (ascending
                # positions: a row is read before a block overwrites it): no second [F, V] beside the kept one.
                # The kept logits are then spent: autograd refuses a second backward through them (version check).
                grad_z_CV = kept[0][span]
                _grad_blocks_(kept[0], target_C, lse_C, grad_C, ctx.temperature, grad_z_CV, positions)
            else:  # the logits made again, and turned into their gradient in place
                grad_z_CV = _logits(h_FH[positions], w_VH, b_V, ctx.dtype)
                _grad_blocks_(grad_z_CV, target_C, lse_C, grad_C, ctx.temperature, grad_z_CV)
            cast_grad_z_CV = grad_z_CV.to(ctx.dtype)
            if grad_h_FH is not None:  # need_h
                grad_h_FH[positions] = (cast_grad_z_CV @ w_cast_VH).to(grad_h_FH.dtype)
            if need_w:
                grad_w_VH = _add_product(grad_w_VH, cast_grad_z_CV.t(), h_FH[positions].to(ctx.dtype), w_VH.dtype)
            if need_b:
                part_V = grad_z_CV.sum(0).to(b_V.dtype)
                grad_b_V = part_V if grad_b_V is None else grad_b_V.add_(part_V)
        if need_w and grad_w_VH is None:  # no position had a gradient
            grad_w_VH = torch.zeros_like(w_VH)
        if need_b and grad_b_V is None:
            grad_b_V = torch.zeros_like(b_V)
        if into_w:
            w_VH.grad, grad_w_VH = grad_w_VH, None
        return grad_h_FH, grad_w_VH, grad_b_V, None, None, None, None, None


def _add_product(acc_VH: torch.Tensor | None, a_VC: torch.Tensor, b_CH: torch.Tensor, dtype) -> torch.Tensor:
    """``acc_VH + a_VC @ b_CH`` in ``dtype``, the product added in place where the dtypes allow (no ``[V, H]``
    product beside the sum); None as ``acc_VH``: the product itself."""
    if acc_VH is None:
        return (a_VC @ b_CH).to(dtype)
    if a_VC.dtype == acc_VH.dtype:
        return acc_VH.addmm_(a_VC, b_CH)
    return acc_VH.add_((a_VC @ b_CH).to(dtype))


def head_logprobs(
    h_FH: torch.Tensor,
    head: torch.nn.Linear,
    target_F: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    dtype: torch.dtype | None = None,
    into_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`token_logprobs` of ``head(h_FH)`` (``h_FH`` ``[F, H]``), with the head's matmul in ``dtype``
    (default: the weight's) made a chunk at a time, and its backward only over positions whose
    log-prob gets a nonzero gradient.

    ``into_grad``: the backward adds the weight's gradient straight into ``head.weight.grad`` (a leaf; made if
    None) instead of handing it to autograd. Why: a weight tied to an input embedding gets a second gradient
    from it, and autograd holds the head's ``[V, H]`` beside that one to add them; with the embedding's made
    sparse (`gspo_core.policy.one_tied_gradient`), the weight's gradient is one ``[V, H]`` buffer. Not for
    :func:`torch.autograd.grad`, which never reads ``.grad``."""
    dtype = dtype or head.weight.dtype
    params = [h_FH, head.weight] + ([head.bias] if head.bias is not None else [])
    if not (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return _head_logprobs_no_grad(h_FH, head.weight, head.bias, target_F, float(temperature), with_entropy, dtype)
    return _HeadLogprobs.apply(
        h_FH, head.weight, head.bias, target_F, float(temperature), bool(with_entropy), dtype, bool(into_grad)
    )


def _head_logprobs_no_grad(h_FH, w_VH, b_V, target_F, temperature: float, with_entropy: bool, dtype):
    """:func:`head_logprobs` where nothing needs a gradient: logits a :data:`NO_GRAD_CHUNK_ELEMENTS` chunk at a
    time on CPU (a :data:`CHUNK_ELEMENTS` one on a GPU), none kept."""
    F, V = h_FH.size(0), w_VH.size(0)
    logp_F, lse_F, entropy_F = _new_outputs(h_FH, F, with_entropy, _logit_dtype(w_VH))
    per = NO_GRAD_CHUNK_ELEMENTS if h_FH.device.type == "cpu" else CHUNK_ELEMENTS  # a GPU's GEMMs want more rows
    for span in _spans(F, per // V):
        z_CV = _logits(h_FH[span], w_VH, b_V, dtype)
        _forward_blocks(z_CV, target_F[span], temperature, with_entropy, logp_F[span], lse_F[span], entropy_F[span])
    return logp_F, entropy_F
