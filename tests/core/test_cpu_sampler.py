"""The inverse-CDF sampler that replaces vLLM's CPU Gumbel kernel: distribution, exclusions, seeding."""

from __future__ import annotations

import pytest
import torch

from gspo_core.rollout.cpu_sampler import inverse_cdf_sample, row_uniforms


def _draw(logits_V: torch.Tensor, n: int, seed: int = 0, block: int = 128) -> torch.Tensor:
    u_N = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return inverse_cdf_sample(logits_V.expand(n, -1).clone(), u_N, block=block)


def assert_frequencies_match(tokens_N: torch.Tensor, p_V: torch.Tensor) -> None:
    """No token of probability 0 drawn, and every token's frequency within 5 standard errors of its
    probability (+ 3 / n: a token of tiny probability may still be drawn once or twice -- Poisson,
    not normal)."""
    n = len(tokens_N)
    freq_V = torch.bincount(tokens_N, minlength=len(p_V)).double() / n
    assert freq_V[p_V == 0].sum() == 0, "a token of probability 0 was drawn"
    assert ((freq_V - p_V).abs() <= 5 * (p_V * (1 - p_V) / n).sqrt() + 3 / n).all(), (freq_V - p_V).abs().max()


@pytest.mark.parametrize("vocab,block,n", [(300, 128, 100_000), (256, 128, 100_000), (50, 8, 100_000),
                                           (1000, 1000, 20_000)])
def test_frequencies_match_softmax(vocab, block, n):
    """Every token's frequency within 5 standard errors of its softmax probability (a ragged last
    block, an exact fit, small blocks, one block), and excluded tokens never drawn."""
    gen = torch.Generator().manual_seed(vocab)
    logits_V = torch.randn(vocab, generator=gen) * 2
    logits_V[::7] = -float("inf")
    assert_frequencies_match(_draw(logits_V, n, block=block), logits_V.double().softmax(-1))


def test_same_tokens_as_an_fp64_inverse_cdf_over_the_whole_vocabulary():
    """At 32k tokens, for the same uniforms, the two-level search returns what one float64 running
    sum over the vocabulary returns (but for uniforms within 1e-9 of a token boundary)."""
    gen = torch.Generator().manual_seed(3)
    logits_BV = torch.randn(256, 32_000, generator=gen) * 3
    logits_BV[:, ::5] = -float("inf")
    u_B = torch.rand(256, dtype=torch.float64, generator=gen)
    cdf_BV = logits_BV.double().softmax(-1).cumsum(-1)
    want_B = torch.searchsorted(cdf_BV, u_B[:, None], right=True).squeeze(1)
    got_B = inverse_cdf_sample(logits_BV.clone(), u_B)
    lo_B = torch.where(want_B > 0, cdf_BV.gather(1, (want_B - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    clear_B = ((u_B - lo_B).abs() > 1e-9) & ((cdf_BV.gather(1, want_B[:, None]).squeeze(1) - u_B).abs() > 1e-9)
    assert clear_B.sum() > 250
    assert torch.equal(got_B[clear_B], want_B[clear_B])


def test_uniform_extremes_pick_the_first_and_last_allowed_tokens():
    logits_BV = torch.full((3, 10), -float("inf"))
    logits_BV[:, [2, 5, 7]] = torch.tensor([0.0, 1.0, 2.0])
    u_B = torch.tensor([0.0, 1 - 2**-53, 0.5], dtype=torch.float64)
    got = inverse_cdf_sample(logits_BV, u_B, block=4)
    assert got[0] == 2 and got[1] == 7 and got[2] in (5, 7)


def test_a_block_sum_rounded_up_in_fp32_never_yields_an_excluded_token():
    """1 + 7e-8 rounds up in fp32 (to 1 + 2**-23), above the block's fp64 running sum: a target near
    the top then lies past the block's last allowed token, which must still be the one returned."""
    logits_BV = torch.tensor([[0.0, float(torch.log(torch.tensor(7e-8, dtype=torch.float64))), -float("inf"),
                               -float("inf")]])
    assert logits_BV.exp().sum().item() > 1 + 1e-7  # the fp32 rounding this test is about
    got = inverse_cdf_sample(logits_BV, torch.tensor([1 - 2**-53], dtype=torch.float64), block=4)
    assert got.item() == 1


def test_a_single_allowed_token_is_always_drawn():
    logits_BV = torch.full((64, 1000), -float("inf"))
    logits_BV[:, 613] = 3.0
    assert (inverse_cdf_sample(logits_BV, torch.rand(64, dtype=torch.float64)) == 613).all()


def test_extreme_logit_range_stays_finite_and_allowed():
    """Logits spanning 1e4 (exp underflows for most tokens) still give the dominant token."""
    logits_BV = torch.full((4, 500), -1e4)
    logits_BV[:, 17] = 0.0
    assert (inverse_cdf_sample(logits_BV, torch.rand(4, dtype=torch.float64)) == 17).all()


def test_seeded_rows_reproduce_and_unseeded_rows_use_the_global_generator():
    def uniforms():
        gens = {0: torch.Generator().manual_seed(5), 2: torch.Generator().manual_seed(6)}
        return torch.stack([row_uniforms(3, gens) for _ in range(4)])  # four decode steps

    torch.manual_seed(0)
    a = uniforms()
    torch.manual_seed(1)
    b = uniforms()
    assert torch.equal(a[:, [0, 2]], b[:, [0, 2]]), "seeded rows depend on their seeds only"
    assert not torch.equal(a[:, 1], b[:, 1]), "unseeded rows follow the global generator"
    assert len(set(a[:, 0].tolist())) == 4, "a seeded row draws afresh at every step"
    assert ((a >= 0) & (a < 1)).all()


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_gather_logprobs_equals_vllms(num_logprobs):
    """Ids, logprobs and ranks exactly as vLLM's own gather (ties, -inf entries, a ragged last block)."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.sampler import Sampler

    from gspo_core.rollout.cpu_sampler import gather_logprobs

    gen = torch.Generator().manual_seed(num_logprobs)
    logits_NV = torch.randint(-20, 20, (37, 1000), generator=gen).float()  # many exact ties
    logits_NV[:, ::9] = -float("inf")
    logprobs_NV = logits_NV.log_softmax(-1)
    tokens_N = torch.randint(0, 1000, (37,), generator=gen)
    tokens_N[0] = 0  # an excluded token: rank counts every entry
    got, want = gather_logprobs(logprobs_NV, num_logprobs, tokens_N), Sampler.gather_logprobs(
        logprobs_NV, num_logprobs, tokens_N)
    for g, w in zip(got[:3], want[:3]):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert got.selected_token_ranks[0] == 1000
