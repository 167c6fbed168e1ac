"""The fused block-wise token log-probs match log_softmax + gather in value, entropy and gradient."""

from __future__ import annotations

import pytest
import torch

import gspo_core.token_logprobs
from gspo_core.token_logprobs import head_logprobs, token_logprobs


def _reference(z_NV, target_N, temperature):
    lp_NV = torch.log_softmax(z_NV / temperature, dim=-1)
    return lp_NV.gather(-1, target_N.unsqueeze(-1)).squeeze(-1), -(lp_NV.exp() * lp_NV).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("n_blocks", [1, 5])
def test_values_entropy_and_gradient_match_the_plain_formula(monkeypatch, temperature, n_blocks):
    N, V = 37, 1000
    # several blocks (37 positions in blocks of 8, the last one short), or all in one
    monkeypatch.setattr(gspo_core.token_logprobs, "BLOCK_ELEMENTS", 8 * V if n_blocks > 1 else N * V)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(N, V, generator=g, dtype=torch.float64) * 4).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g, dtype=torch.float64)  # an arbitrary upstream gradient

    logp, ent = token_logprobs(z, target, temperature, with_entropy=True)
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
    logp, ent = token_logprobs(z, target)
    assert ent.numel() == 0
    torch.testing.assert_close(logp.double(), _reference(z.double(), target, 1.0)[0], atol=1e-5, rtol=0)


def test_gradcheck_in_double():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (6,), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, target, 1.3)[0], (z,))


def _head_case(seed: int, N: int = 37, H: int = 12, V: int = 300, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_()
    head = torch.nn.Linear(H, V, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
    target = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g, dtype=torch.float64)
    w[::3] = 0.0  # positions with no gradient (padding, clipped sequences): skipped by the backward
    return h, head, target, w


def _grads(h, head, loss):
    params = [h, *[p for p in head.parameters() if p.requires_grad]]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("logits", ["kept", "recomputed"])
def test_head_logprobs_match_the_head_then_the_plain_formula(monkeypatch, temperature, logits):
    h, head, target, w = _head_case(3)
    monkeypatch.setattr(
        gspo_core.token_logprobs, "CHUNK_ELEMENTS", 5 * head.out_features
    )  # 37 positions in chunks of 5
    if logits == "recomputed":
        monkeypatch.setattr(gspo_core.token_logprobs, "KEEP_LOGITS_ELEMENTS", 0)
    monkeypatch.setattr(gspo_core.token_logprobs, "BLOCK_ELEMENTS", 2 * head.out_features)
    logp, ent = head_logprobs(h, head, target, temperature, with_entropy=True)
    ref_logp, ref_ent = _reference(head(h), target, temperature)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent.detach())
    assert not ent.requires_grad
    for got, want in zip(_grads(h, head, (logp * w).sum()), _grads(h, head, (ref_logp * w).sum()), strict=True):
        torch.testing.assert_close(got, want)


def test_head_backward_runs_only_over_positions_with_a_gradient(monkeypatch):
    h, head, target, w = _head_case(4, bias=False)
    monkeypatch.setattr(gspo_core.token_logprobs, "CHUNK_ELEMENTS", 10 * head.out_features)
    monkeypatch.setattr(gspo_core.token_logprobs, "KEEP_LOGITS_ELEMENTS", 0)  # recomputed: each backward chunk is seen
    rows = []
    real = gspo_core.token_logprobs._logits
    monkeypatch.setattr(
        gspo_core.token_logprobs, "_logits", lambda h_CH, *a: rows.append(h_CH.size(0)) or real(h_CH, *a)
    )
    logp, _ = head_logprobs(h, head, target)
    assert sum(rows) == 37
    rows.clear()
    gh, gw = _grads(h, head, (logp * w).sum())
    assert sum(rows) == int((w != 0).sum()) == 24
    assert (gh[w == 0] == 0).all() and gh[w != 0].abs().sum(-1).min() > 0 and gw.abs().sum() > 0


def test_head_logprobs_in_bf16_and_a_frozen_head():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(20, 16, generator=g).requires_grad_()
    head = torch.nn.Linear(16, 500, bias=False).requires_grad_(False)  # frozen, as under LoRA
    target = torch.randint(0, 500, (20,), generator=g)
    logp, _ = head_logprobs(h, head, target, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = head(h)
    torch.testing.assert_close(logp, _reference(z.float(), target, 1.0)[0], atol=1e-5, rtol=1e-5)
    assert logp.dtype == torch.float32
    (gh,) = torch.autograd.grad(logp.sum(), [h])
    (ref,) = torch.autograd.grad(_reference(head(h), target, 1.0)[0].sum(), [h])
    assert gh.dtype == torch.float32 and head.weight.grad is None
    torch.testing.assert_close(gh, ref, atol=0.05, rtol=0.05)


def test_head_backward_with_no_live_position_gives_zero_gradients():
    h, head, target, _ = _head_case(6)
    logp, _ = head_logprobs(h, head, target)
    gh, gw, gb = _grads(h, head, (logp * 0.0).sum())
    assert gh.shape == h.shape and gw.shape == head.weight.shape and gb.shape == head.bias.shape
    assert not gh.any() and not gw.any() and not gb.any()


def test_without_a_gradient_the_logits_are_made_a_small_chunk_at_a_time(monkeypatch):
    """Old log-probs and evaluations need no gradient: the logits are never all made at once (at a 49k
    vocabulary they were up to KEEP_LOGITS_ELEMENTS, 1 GiB of fp32, per no-grad forward), same values."""
    h, head, target, _ = _head_case(6)
    monkeypatch.setattr(gspo_core.token_logprobs, "NO_GRAD_CHUNK_ELEMENTS", 5 * head.out_features, raising=False)
    rows = []
    real = gspo_core.token_logprobs._logits
    monkeypatch.setattr(
        gspo_core.token_logprobs, "_logits", lambda h_CH, *a: rows.append(h_CH.size(0)) or real(h_CH, *a)
    )
    with torch.no_grad():
        logp, ent = head_logprobs(h, head, target, 0.7, with_entropy=True)
        ref_logp, ref_ent = _reference(head(h), target, 0.7)
    assert max(rows) == 5 and sum(rows) == 37
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)


def test_the_kept_logits_become_their_gradient_so_a_second_backward_is_refused():
    """The backward turns the kept logits into their gradient in place (no second [F, V] buffer,
    tests/core/test_memory.py): a second backward through the same graph must fail, not read spent logits."""
    h, head, target, w = _head_case(7)
    loss = (head_logprobs(h, head, target)[0] * w).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_softmax_blocks_are_cache_sized_on_cpu_and_whole_chunks_on_a_gpu():
    """On a GPU a block of 3 positions (a 152k vocabulary's share of a CPU block) meant thousands of kernel
    launches a forward (the H200's update 12x slower, docs/bench.md); there a kept chunk is one block."""
    from gspo_core.token_logprobs import KEEP_LOGITS_ELEMENTS, _blocks

    V = 151_936
    positions = KEEP_LOGITS_ELEMENTS // V
    assert len(_blocks(positions, V, torch.device("cpu"))) > 500
    assert _blocks(positions, V, torch.device("cuda")) == [slice(0, positions)]
