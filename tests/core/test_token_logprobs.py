"""The fused block-wise token log-probs match log_softmax + gather in value, entropy and gradient."""

from __future__ import annotations

import pytest
import torch

from gspo_core import token_logprobs as TL


def _reference(z_NV, target_N, temperature):
    lp_NV = torch.log_softmax(z_NV / temperature, dim=-1)
    return lp_NV.gather(-1, target_N.unsqueeze(-1)).squeeze(-1), -(lp_NV.exp() * lp_NV).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("n_blocks", [1, 5])
def test_values_entropy_and_gradient_match_the_plain_formula(monkeypatch, temperature, n_blocks):
    N, V = 37, 1000
    # several blocks (37 positions in blocks of 8, the last one short), or all in one
    monkeypatch.setattr(TL, "BLOCK_ELEMENTS", 8 * V if n_blocks > 1 else N * V)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(N, V, generator=g, dtype=torch.float64) * 4).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g, dtype=torch.float64)  # an arbitrary upstream gradient

    logp, ent = TL.token_logprobs(z, target, temperature, with_entropy=True)
    (logp * w).sum().backward()
    grad, z.grad = z.grad.clone(), None
    ref_logp, ref_ent = _reference(z, target, temperature)
    (ref_logp * w).sum().backward()

    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent.detach())
    torch.testing.assert_close(grad, z.grad)
    assert not ent.requires_grad


def test_fp32_agrees_with_fp64_and_needs_no_entropy():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(64, 32000, generator=g) * 3
    target = torch.randint(0, 32000, (64,), generator=g)
    logp, ent = TL.token_logprobs(z, target)
    assert ent.numel() == 0
    torch.testing.assert_close(logp.double(), _reference(z.double(), target, 1.0)[0], atol=1e-5, rtol=0)


def test_gradcheck_in_double():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (6,), generator=g)
    assert torch.autograd.gradcheck(lambda x: TL.token_logprobs(x, target, 1.3)[0], (z,))
