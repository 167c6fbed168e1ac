"""GSPO / GSPO-token / GRPO losses against hand-computed values, gradients and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_core import losses as _losses  # noqa: F401  (registers)
from gspo_core.registry import LOSSES

EL, EH = 3e-4, 4e-4  # the paper's GSPO clip range
WL, WH = 0.2, 0.28  # a wide, asymmetric range for hand examples


@pytest.fixture(autouse=True)
def _float64():
    """Hand values below are exact decimals: build every tensor in float64 (restored afterwards)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(prev)


def grads(loss_name, new, old, adv, mask, el=EL, eh=EH):
    new = new.clone().double().requires_grad_(True)
    loss, m = LOSSES.get(loss_name)(new, old.double(), adv.double(), mask.double(), el, eh)
    loss.backward()
    return loss.detach(), new.grad, m


def test_registry_names():
    assert {"gspo", "gspo_token", "grpo"} <= set(LOSSES.names())
    with pytest.raises(KeyError, match="known:"):
        LOSSES.get("nope")


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_on_policy_is_plain_policy_gradient(name):
    torch.manual_seed(0)
    new = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    loss, g, m = grads(name, new, new.clone(), adv, mask)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-12)
    # d loss / d logp_new[b, t] = -A_b / (B * n_b) on valid tokens, 0 on padding
    expected = -(adv.double() / 3).unsqueeze(-1) * mask.double() / mask.double().sum(-1, keepdim=True)
    assert torch.allclose(g, expected, atol=1e-12)
    assert g[0, 0].item() == pytest.approx(-1.0 / (3 * 3))
    assert g[2, 0].item() == pytest.approx(-2.0 / (3 * 1))
    assert m["ratio/mean"] == pytest.approx(1.0) and m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0
    assert m["clip/low_frac"] == 0 and m["clip/high_frac"] == 0


def test_gspo_off_policy_unclipped_value_and_gradient():
    # per-token log-ratios; sequence ratio s_b = exp(mean over valid tokens)
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, -0.05, 0.0], [0.1, 0.2, 9.0]])  # last token of row 1 is padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    s0, s1 = math.exp(0.05 / 3), math.exp(0.15)
    loss, g, m = grads("gspo", new, old, adv, mask, WL, WH)
    assert loss.item() == pytest.approx(-(s0 * 2.0 + s1 * -1.0) / 2, rel=1e-12)
    expected = torch.tensor([[-2.0 * s0 / (2 * 3)] * 3, [1.0 * s1 / (2 * 2)] * 2 + [0.0]], dtype=torch.float64)
    assert torch.allclose(g, expected, atol=1e-12)
    assert m["ratio/mean"] == pytest.approx((s0 + s1) / 2)
    assert m["ratio/min"] == pytest.approx(s0) and m["ratio/max"] == pytest.approx(s1)


def test_gspo_clip_fractions_exact_and_clipped_sequences_get_no_gradient():
    # mean log-ratios per sequence (eps_low 0.2 -> lower bound 0.8, eps_high 0.28 -> upper bound 1.28)
    logr = [0.5, -0.5, 0.5, -0.5, 0.0, math.log(1.25), math.log(0.78), math.log(1.25)]
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    # 0: s=1.65 > 1.28, A>0  -> high clip          1: s=0.61 < 0.8, A<0 -> low clip
    # 2: s>1.28, A<0 -> unclipped (pessimistic)   3: s<0.8, A>0 -> unclipped
    # 4: s=1 inside                                5: s=1.25 inside [0.8, 1.28] (eps_high, not eps_low, bounds it)
    # 6: s=0.78 < 0.8, A<0 -> low clip             7: s=1.25 inside, A<0
    B, T = len(logr), 4
    new = torch.tensor(logr).unsqueeze(-1).expand(B, T).clone()
    new[:, 3] = 5.0  # padding, arbitrary
    mask = torch.ones(B, T)
    mask[:, 3] = 0
    old = torch.zeros(B, T)
    loss, g, m = grads("gspo", new, old, adv, mask, WL, WH)
    assert m["clip/high_frac"] == pytest.approx(1 / 8)
    assert m["clip/low_frac"] == pytest.approx(2 / 8)
    for b in (0, 1, 6):
        assert torch.all(g[b] == 0), b
    s = [math.exp(x) for x in logr]
    for b in (2, 3, 4, 5, 7):  # unclipped: -A_b s_b / (B n_b) on the 3 valid tokens
        assert g[b, :3].tolist() == pytest.approx([-adv[b].item() * s[b] / (B * 3)] * 3, rel=1e-9), b
        assert g[b, 3] == 0
    terms = [min(s[b] * adv[b].item(), min(max(s[b], 1 - WL), 1 + WH) * adv[b].item()) for b in range(B)]
    assert loss.item() == pytest.approx(-sum(terms) / B, rel=1e-12)
    assert terms[0] == pytest.approx(1.28) and terms[1] == pytest.approx(-0.8) and terms[6] == pytest.approx(-0.8)
    assert m["ratio/max"] == pytest.approx(math.exp(0.5)) and m["ratio/min"] == pytest.approx(math.exp(-0.5))
    assert m["ratio/mean"] == pytest.approx(sum(s) / B)


def test_gspo_clip_fractions_paper_eps():
    mask = torch.ones(4, 2)
    old = torch.zeros(4, 2)
    # per-sequence mean log-ratio: +1e-3 (above 1+eh), -1e-3 (below 1-el), +1e-3, 0
    new = torch.tensor([[1e-3, 1e-3], [-1e-3, -1e-3], [1e-3, 1e-3], [0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    _, g, m = grads("gspo", new, old, adv, mask)
    assert m["clip/high_frac"] == pytest.approx(0.25) and m["clip/low_frac"] == pytest.approx(0.25)
    assert torch.all(g[0] == 0) and torch.all(g[1] == 0)
    assert torch.all(g[2] != 0) and torch.all(g[3] != 0)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_padding_changes_nothing(name):
    torch.manual_seed(1)
    new, old = torch.randn(2, 3), torch.randn(2, 3) * 0.001
    old = new + old
    new_p = torch.cat([new, torch.randn(2, 4) * 10], 1)
    old_p = torch.cat([old, torch.randn(2, 4) * 10], 1)
    mask, mask_p = torch.ones(2, 3), torch.cat([torch.ones(2, 3), torch.zeros(2, 4)], 1)
    adv = torch.tensor([0.7, -1.2])
    for el, eh in ((EL, EH), (WL, WH)):
        l1, g1, m1 = grads(name, new, old, adv, mask, el, eh)
        l2, g2, m2 = grads(name, new_p, old_p, adv, mask_p, el, eh)
        assert l1.item() == pytest.approx(l2.item(), abs=1e-12)
        assert torch.allclose(g1, g2[:, :3], atol=1e-12) and torch.all(g2[:, 3:] == 0)
        assert m1 == pytest.approx(m2)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_padding_with_extreme_pad_values(name):
    new = torch.tensor([[-1.0, -2.0, 0.0, 0.0]])
    old = torch.tensor([[-1.1, -2.0, -1e4, -1e4]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    for a in (1.0, -1.0):
        l1, g1, _ = grads(name, new[:, :2], old[:, :2], torch.tensor([a]), mask[:, :2], WL, WH)
        l2, g2, _ = grads(name, new, old, torch.tensor([a]), mask, WL, WH)
        assert torch.isfinite(l2) and torch.all(torch.isfinite(g2))
        assert l1.item() == pytest.approx(l2.item(), abs=1e-12)
        assert torch.allclose(g1, g2[:, :2], atol=1e-12) and torch.all(g2[:, 2:] == 0)


@pytest.mark.parametrize("el,eh,scale", [(EL, EH, 1e-5), (EL, EH, 1e-2), (WL, WH, 0.3), (WL, WH, 1.0)])
def test_gspo_token_equals_gspo_with_sequence_advantages(el, eh, scale):
    torch.manual_seed(2)
    new = torch.randn(6, 7)
    old = new + torch.randn(6, 7) * scale
    mask = (torch.rand(6, 7) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3, 2.0, -2.0])
    l1, g1, m1 = grads("gspo", new, old, adv, mask, el, eh)
    l2, g2, _ = grads("gspo_token", new, old, adv, mask, el, eh)
    l3, g3, _ = grads("gspo_token", new, old, adv.unsqueeze(-1).expand(6, 7).clone(), mask, el, eh)
    assert l1.item() == pytest.approx(l2.item(), abs=1e-12)
    assert l1.item() == pytest.approx(l3.item(), abs=1e-12)
    assert torch.allclose(g1, g2, atol=1e-12) and torch.allclose(g1, g3, atol=1e-12)
    if scale >= 1e-2:  # the case really exercises clipping
        assert m1["clip/low_frac"] + m1["clip/high_frac"] > 0
    if scale <= 1e-5:
        assert m1["clip/low_frac"] + m1["clip/high_frac"] == 0


def test_gspo_token_per_token_advantages_hand_gradient():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.02, 0.04, 0.0], [-0.1, 0.1, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv_BT = torch.tensor([[1.0, -2.0, 7.0], [0.5, 0.0, -1.0]])
    s = [math.exp(0.03), math.exp(0.1)]
    loss, g, m = grads("gspo_token", new, old, adv_BT, mask, WL, WH)
    # each token's ratio is the (detached) sequence ratio; its gradient is s_b on that token only
    exp_loss = (-(s[0] * 1.0 + s[0] * -2.0) / 2 + -(s[1] * 0.5 + 0.0 + s[1] * -1.0) / 3) / 2
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    exp_g = [[-1.0 * s[0] / 4, 2.0 * s[0] / 4, 0.0], [-0.5 * s[1] / 6, 0.0, 1.0 * s[1] / 6]]
    assert torch.allclose(g, torch.tensor(exp_g, dtype=torch.float64), atol=1e-12)
    # metrics are per valid token (5 tokens), every token carries its sequence's ratio
    assert m["ratio/mean"] == pytest.approx((2 * s[0] + 3 * s[1]) / 5)
    assert m["ratio/min"] == pytest.approx(s[0]) and m["ratio/max"] == pytest.approx(s[1])


def test_sequence_ratio_is_length_normalised():
    old = torch.zeros(2, 8)
    new = torch.full((2, 8), 0.05)
    mask = torch.zeros(2, 8)
    mask[0, :2] = 1
    mask[1, :8] = 1
    loss, g, m = grads("gspo", new, old, torch.tensor([1.0, 1.0]), mask, WL, WH)
    s = math.exp(0.05)  # not exp(2 * 0.05) nor exp(8 * 0.05)
    assert m["ratio/min"] == pytest.approx(s) and m["ratio/max"] == pytest.approx(s)
    assert m["ratio/mean"] == pytest.approx(s)
    assert loss.item() == pytest.approx(-s)
    # each sequence's total gradient weight is the same, whatever its length
    assert g[0].sum().item() == pytest.approx(g[1].sum().item()) == pytest.approx(-s / 2)


def test_grpo_clips_per_token_hand_example():
    old = torch.zeros(2, 4)
    # row 0 (A=+1): tokens above / inside / below / inside; row 1 (A=-1): below / inside / pad / pad
    new = torch.tensor([[0.5, 0.1, -0.5, 0.0], [-0.5, 0.2, 3.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, g, m = grads("grpo", new, old, adv, mask, WL, WH)
    r = [[math.exp(x) for x in row] for row in new.tolist()]
    # 6 valid tokens: token (0,0) clipped high (r>1.28, A>0), token (1,0) clipped low (r<0.8, A<0);
    # token (0,2) r<0.8 but A>0 -> unclipped
    assert m["clip/high_frac"] == pytest.approx(1 / 6) and m["clip/low_frac"] == pytest.approx(1 / 6)
    assert g[0, 0] == 0 and g[1, 0] == 0 and torch.all(g[1, 2:] == 0)
    assert g[0, 1].item() == pytest.approx(-r[0][1] / (2 * 4))
    assert g[0, 2].item() == pytest.approx(-r[0][2] / (2 * 4))
    assert g[0, 3].item() == pytest.approx(-1.0 / (2 * 4))
    assert g[1, 1].item() == pytest.approx(r[1][1] / (2 * 2))
    row0 = -(1.28 + r[0][1] + r[0][2] + r[0][3]) / 4
    row1 = -(-0.8 + -r[1][1]) / 2
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-12)
    valid = [r[0][0], r[0][1], r[0][2], r[0][3], r[1][0], r[1][1]]
    assert m["ratio/mean"] == pytest.approx(sum(valid) / 6)
    assert m["ratio/min"] == pytest.approx(math.exp(-0.5)) and m["ratio/max"] == pytest.approx(math.exp(0.5))


def test_grpo_clips_per_token_paper_eps():
    old = torch.zeros(1, 4)
    new = torch.tensor([[1e-3, 0.0, -1e-3, 0.0]])
    _, g, m = grads("grpo", new, old, torch.tensor([1.0]), torch.ones(1, 4))
    assert m["clip/high_frac"] == pytest.approx(0.25) and m["clip/low_frac"] == 0
    assert g[0, 0] == 0 and torch.all(g[0, 1:] != 0)


def test_ratio_metrics_gspo_hand_example():
    old = torch.zeros(3, 2)
    new = torch.tensor([[0.2, 0.4], [-0.2, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    _, _, m = grads("gspo", new, old, torch.tensor([0.0, 0.0, 0.0]), mask, WL, WH)
    s = [math.exp(0.3), math.exp(-0.1), 1.0]
    assert m["ratio/mean"] == pytest.approx(sum(s) / 3)
    assert m["ratio/min"] == pytest.approx(math.exp(-0.1)) and m["ratio/max"] == pytest.approx(math.exp(0.3))
    assert m["clip/low_frac"] == 0 and m["clip/high_frac"] == 0  # A = 0 never counts as clipped
    assert all(isinstance(v, float) for v in m.values())


def test_loss_works_in_float32_and_returns_scalar():
    torch.manual_seed(3)
    new = torch.randn(2, 5, dtype=torch.float32, requires_grad=True)
    old = new.detach() + 0.01
    for name in ("gspo", "gspo_token", "grpo"):
        loss, m = LOSSES.get(name)(
            new, old, torch.tensor([1.0, -1.0], dtype=torch.float32), torch.ones(2, 5, dtype=torch.long), EL, EH
        )
        assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
        assert set(m) == {"clip/low_frac", "clip/high_frac", "ratio/mean", "ratio/min", "ratio/max"}


def test_the_names_a_job_may_give_are_the_registered_ones():
    from typing import get_args

    from gspo_core import advantages  # noqa: F401  (registers the estimators)
    from gspo_core.config import AdvantageName, LossName
    from gspo_core.registry import ADVANTAGES

    assert sorted(get_args(LossName)) == LOSSES.names() and sorted(get_args(AdvantageName)) == ADVANTAGES.names()
    assert {n: LOSSES.get(n).ratio_unit for n in LOSSES.names()} == {
        "gspo": "sequence",
        "gspo_token": "token",
        "grpo": "token",
    }


@pytest.mark.parametrize("name", LOSSES.names())
def test_metrics_added_over_micro_batches_are_the_whole_batchs(name):
    """LossMetrics over parts of a mini-batch (as the update's micro-batches) gives the metrics of one
    evaluation over all its rows: the loss, ratio mean and extremes, clip fractions, entropy."""
    from gspo_core.losses import LossMetrics

    g = torch.Generator().manual_seed(3)
    new_BT = -torch.rand(6, 5, generator=g)
    old_BT = new_BT + 0.01 * torch.randn(6, 5, generator=g)
    adv_B = torch.randn(6, generator=g)
    mask_BT = torch.ones(6, 5)
    mask_BT[1, 3:] = 0
    mask_BT[4, 1:] = 0
    fn = LOSSES.get(name)
    loss, want = fn(new_BT, old_BT, adv_B, mask_BT, 3e-3, 4e-3)
    whole = LossMetrics(fn, 6)
    whole.add(loss, want, 0.5, mask_BT, 6)
    parts = LossMetrics(fn, 6)
    for s in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part_loss, m = fn(new_BT[s], old_BT[s], adv_B[s], mask_BT[s], 3e-3, 4e-3)
        parts.add(part_loss, m, 0.5, mask_BT[s], s.stop - s.start)
    got = parts.result()
    assert want["clip/low_frac"] + want["clip/high_frac"] > 0  # the fractions are exercised
    for key, value in whole.result().items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_environment_tokens_are_isolated_from_the_loss(name):
    """An episode's environment tokens (mask 0 inside a row, between sampled ones): whatever the log-probs
    there (the logits at those positions), the loss, its gradient and the metrics are exactly the same,
    and the gradient there is exactly 0."""
    torch.manual_seed(3)
    new = torch.randn(3, 8)
    old = new + torch.randn(3, 8) * 0.01
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1], [1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]).double()
    adv = torch.tensor([0.9, -1.1, 0.2])
    for el, eh in ((EL, EH), (WL, WH)):
        l1, g1, m1 = grads(name, new, old, adv, mask, el, eh)
        noise = torch.randn(3, 8) * 1e3 * (1 - mask)
        l2, g2, m2 = grads(name, new + noise, old - noise, adv, mask, el, eh)
        assert l1.item() == l2.item() and m1 == m2
        assert torch.equal(g1, g2) and torch.all(g2[mask == 0] == 0)
        assert el == EL or torch.all(g2[mask == 1] != 0)  # the paper's range clips some sequences: no gradient
