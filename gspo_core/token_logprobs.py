"""Token log-probs (and entropy) from LM-head outputs, a cache-sized chunk at a time, with its own backward.

``log_softmax`` + ``gather`` + an entropy over a ``[B, T, V]`` logits tensor make about a dozen
full passes over it in forward and backward (the division by the temperature, the log-softmax
output, its exp for the entropy, the gather's zero-filled gradient, the log-softmax backward...),
each one a trip to memory at 32k-150k vocabularies. Here the forward keeps one row block of
positions in cache for all of its work and writes only ``[B, T]`` results, and the backward makes
the one ``[B, T, V]`` gradient it has to in one pass per block. Same values and gradients up to
fp32 rounding (tests/core/test_token_logprobs.py checks both against the plain formula).
"""

from __future__ import annotations

import torch

#: Elements of one block (positions x vocabulary): ~2 MiB of fp32, so a block's temporaries stay in cache.
BLOCK_ELEMENTS = 1 << 19


def _blocks(n_positions: int, vocab: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    return [slice(i, min(i + step, n_positions)) for i in range(0, n_positions, step)]


class _TokenLogprobs(torch.autograd.Function):
    """``z_NV`` (head outputs of ``N`` positions) -> ``logp_N``, ``entropy_N`` of softmax(z / temperature)."""

    @staticmethod
    def forward(ctx, z_NV: torch.Tensor, target_N: torch.Tensor, temperature: float, with_entropy: bool):
        logp_N = z_NV.new_empty(z_NV.size(0))
        lse_N = z_NV.new_empty(z_NV.size(0))
        ent_N = z_NV.new_zeros(z_NV.size(0) if with_entropy else 0)
        for s in _blocks(z_NV.size(0), z_NV.size(1)):
            x = z_NV[s] / temperature if temperature != 1.0 else z_NV[s]
            lp = x.log_softmax(-1)
            logp_N[s] = lp.gather(-1, target_N[s].unsqueeze(-1)).squeeze(-1)
            lse_N[s] = x.gather(-1, target_N[s].unsqueeze(-1)).squeeze(-1) - logp_N[s]
            if with_entropy:
                ent_N[s] = -(lp.exp() * lp).sum(-1)
        ctx.save_for_backward(z_NV, target_N, lse_N)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, grad_logp_N: torch.Tensor, _grad_ent):
        z_NV, target_N, lse_N = ctx.saved_tensors
        t = ctx.temperature
        grad_NV = torch.empty_like(z_NV)
        # d logp / d z = (onehot(target) - softmax(z / t)) / t
        g_N = grad_logp_N / t
        for s in _blocks(z_NV.size(0), z_NV.size(1)):
            x = z_NV[s] / t if t != 1.0 else z_NV[s]
            p = grad_NV[s]  # the block is built in place in the output: one write of [N, V] in all
            torch.sub(x, lse_N[s].unsqueeze(-1), out=p).exp_().mul_(-g_N[s].unsqueeze(-1))
            p.scatter_add_(-1, target_N[s].unsqueeze(-1), g_N[s].unsqueeze(-1))
        return grad_NV, None, None, None


def token_logprobs(z_NV: torch.Tensor, target_N: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(z_NV / temperature)[n, target_N[n]]`` ``[N]`` and, when asked, each position's
    entropy ``[N]`` (detached; an empty tensor otherwise). ``z_NV`` is fp32 head output ``[N, V]``."""
    return _TokenLogprobs.apply(z_NV, target_N, float(temperature), bool(with_entropy))
