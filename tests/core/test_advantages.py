"""Group-relative advantages against hand-computed values; zero-variance groups are counted."""

from __future__ import annotations

import pytest
import torch

from gspo_core import advantages as _adv  # noqa: F401  (registers)
from gspo_core.registry import ADVANTAGES

group_norm = ADVANTAGES.get("group_norm")


def test_group_norm_scaled_and_unscaled():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv, m = group_norm(r, 4, scale=True)
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 + 1e-6))
    assert torch.all(adv[4:] == 0) and m["reward/frac_zero_std"] == 0.5
    adv2, _ = group_norm(r, 4, scale=False)
    assert torch.allclose(adv2[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_groups_are_independent_and_centred():
    r = torch.tensor([3.0, 1.0, 2.0, 10.0, 20.0, 30.0])
    adv, m = group_norm(r, 3, scale=True)
    # population std of (3, 1, 2) is sqrt(2/3); of (10, 20, 30) is 10*sqrt(2/3)
    s = (2 / 3) ** 0.5
    assert torch.allclose(adv, torch.tensor([1 / s, -1 / s, 0.0, -1 / s, 0.0, 1 / s]), atol=1e-5)
    assert torch.allclose(adv.view(2, 3).sum(-1), torch.zeros(2), atol=1e-6)
    assert m["reward/frac_zero_std"] == 0.0


def test_all_groups_constant_gives_zero_advantages():
    adv, m = group_norm(torch.tensor([0.0, 0.0, 1.0, 1.0]), 2)
    assert torch.all(adv == 0) and m["reward/frac_zero_std"] == 1.0


def test_rewards_not_a_multiple_of_the_group_size_are_refused():
    with pytest.raises(ValueError, match="rewards_N"):
        group_norm(torch.zeros(5), 4)
    with pytest.raises(KeyError, match="known: group_norm"):
        ADVANTAGES.get("nope")


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("value", [0.3, 0.7, 1 / 3])
def test_tied_groups_are_exactly_zero_whatever_the_rounding(value, scale):
    """r - mean of twelve 0.7s is ~1e-7, not 0: divided by std + 1e-6 it was a push of up to 0.1."""
    r = torch.cat([torch.full((12,), value), torch.linspace(0, 1, 12)])
    adv, m = group_norm(r, 12, scale=scale)
    assert torch.all(adv[:12] == 0) and m["reward/frac_zero_std"] == 0.5
    assert adv[12:].abs().min() > 0
