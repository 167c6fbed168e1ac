"""GSPO / GSPO-token / GRPO losses and group advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_core import advantages as _adv  # noqa: F401  (registers)
from gspo_core import losses as _losses  # noqa: F401  (registers)
from gspo_core.registry import ADVANTAGES, LOSSES

EL, EH = 3e-4, 4e-4


def grads(loss_name, new, old, adv, mask):
    new = new.clone().requires_grad_(True)
    loss, m = LOSSES.get(loss_name)(new, old, adv, mask, EL, EH)
    loss.backward()
    return loss.detach(), new.grad, m


def test_on_policy_gspo_is_plain_policy_gradient():
    torch.manual_seed(0)
    new = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    loss, g, m = grads("gspo", new, new.clone(), adv, mask)
    assert loss.item() == pytest.approx(-adv.mean().item())
    expected = -(adv / 3).unsqueeze(-1) * mask / mask.sum(-1, keepdim=True)
    assert torch.allclose(g, expected, atol=1e-7)
    assert m["ratio/mean"] == pytest.approx(1.0) and m["clip/low_frac"] == 0 and m["clip/high_frac"] == 0


def test_clip_fractions_and_zero_gradient_when_clipped():
    mask = torch.ones(4, 2)
    old = torch.zeros(4, 2)
    # per-sequence mean log-ratio: +1e-3 (above 1+eh), -1e-3 (below 1-el), +1e-3, 0
    new = torch.tensor([[1e-3, 1e-3], [-1e-3, -1e-3], [1e-3, 1e-3], [0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    _, g, m = grads("gspo", new, old, adv, mask)
    assert m["clip/high_frac"] == pytest.approx(0.25) and m["clip/low_frac"] == pytest.approx(0.25)
    assert torch.all(g[0] == 0) and torch.all(g[1] == 0)  # clipped: no gradient
    assert torch.all(g[2] != 0) and torch.all(g[3] != 0)  # ratio > 1 with A < 0 is not clipped (pessimistic)
    assert m["ratio/max"] == pytest.approx(math.exp(1e-3), rel=1e-6)
    assert m["ratio/min"] == pytest.approx(math.exp(-1e-3), rel=1e-6)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_padding_changes_nothing(name):
    torch.manual_seed(1)
    new, old = torch.randn(2, 3), torch.randn(2, 3) * 0.001
    new_p = torch.cat([new, torch.randn(2, 4)], 1)
    old_p = torch.cat([old, torch.randn(2, 4)], 1)
    mask, mask_p = torch.ones(2, 3), torch.cat([torch.ones(2, 3), torch.zeros(2, 4)], 1)
    adv = torch.tensor([0.7, -1.2])
    l1, g1, _ = grads(name, new, old, adv, mask)
    l2, g2, _ = grads(name, new_p, old_p, adv, mask_p)
    assert l1.item() == pytest.approx(l2.item(), abs=1e-7)
    assert torch.allclose(g1, g2[:, :3], atol=1e-7) and torch.all(g2[:, 3:] == 0)


@pytest.mark.parametrize("scale", [1e-5, 1e-2])  # inside and outside the clip range
def test_gspo_token_equals_gspo_with_sequence_advantages(scale):
    torch.manual_seed(2)
    new, old = torch.randn(4, 6), torch.randn(4, 6)
    old = new.detach() + torch.randn(4, 6) * scale
    mask = (torch.rand(4, 6) > 0.2).float()
    mask[:, 0] = 1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3])
    l1, g1, _ = grads("gspo", new, old, adv, mask)
    l2, g2, _ = grads("gspo_token", new, old, adv, mask)
    l3, g3, _ = grads("gspo_token", new, old, adv.unsqueeze(-1).expand(4, 6).clone(), mask)
    assert l1.item() == pytest.approx(l2.item(), abs=1e-7) == pytest.approx(l3.item(), abs=1e-7)
    assert torch.allclose(g1, g2, atol=1e-7) and torch.allclose(g1, g3, atol=1e-7)


def test_sequence_ratio_is_length_normalised():
    old = torch.zeros(2, 8)
    new = torch.full((2, 8), 2e-4)
    mask = torch.zeros(2, 8)
    mask[0, :2] = 1
    mask[1, :8] = 1
    _, _, m = grads("gspo", new, old, torch.tensor([1.0, 1.0]), mask)
    assert m["ratio/min"] == pytest.approx(m["ratio/max"]) == pytest.approx(math.exp(2e-4))


def test_grpo_clips_per_token():
    old = torch.zeros(1, 4)
    new = torch.tensor([[1e-3, 0.0, -1e-3, 0.0]])
    _, g, m = grads("grpo", new, old, torch.tensor([1.0]), torch.ones(1, 4))
    assert m["clip/high_frac"] == pytest.approx(0.25) and m["clip/low_frac"] == 0
    assert g[0, 0] == 0 and torch.all(g[0, 1:] != 0)


def test_group_norm_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv, m = ADVANTAGES.get("group_norm")(r, 4, scale=True)
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 + 1e-6))
    assert torch.all(adv[4:] == 0) and m["reward/frac_zero_std"] == 0.5
    adv2, _ = ADVANTAGES.get("group_norm")(r, 4, scale=False)
    assert torch.allclose(adv2[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(KeyError, match="known: group_norm"):
        ADVANTAGES.get("nope")
