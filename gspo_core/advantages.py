"""Advantage estimators as pure tensor functions, registered by name."""

from __future__ import annotations

import torch

from gspo_core.registry import ADVANTAGES


@ADVANTAGES.register("group_norm")
def group_norm(rewards_B: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6):
    """Group-relative advantages ``A_i = (r_i - mean_group) / (std_group + eps)``.

    ``rewards_B`` holds ``B = num_groups * group_size`` rewards, each group contiguous. With
    ``scale=False`` the std division is skipped (Dr. GRPO style). Returns ``(adv_B, metrics)``
    where ``reward/frac_zero_std`` is the fraction of groups whose rewards are all equal: they carry
    no learning signal, and their advantages are exactly 0 (``r - mean`` alone would leave float
    rounding, e.g. up to 0.1 for twelve rewards of 0.7 divided by ``std + eps``, a push in an
    arbitrary direction; exact zeros also let the update skip those rows).
    """
    if rewards_B.dim() != 1 or rewards_B.numel() % group_size:
        raise ValueError(
            f"rewards_B: expected a flat tensor of groups of {group_size}, got shape {tuple(rewards_B.shape)}"
        )
    r_GN = rewards_B.float().view(-1, group_size)
    mean_G1 = r_GN.mean(-1, keepdim=True)
    std_G1 = r_GN.std(-1, keepdim=True, unbiased=False)
    adv_GN = r_GN - mean_G1
    if scale:
        adv_GN = adv_GN / (std_G1 + eps)
    tied_G1 = (r_GN == r_GN[:, :1]).all(-1, keepdim=True)
    adv_GN = adv_GN.masked_fill(tied_G1, 0.0)
    return adv_GN.reshape(-1), {"reward/frac_zero_std": float(tied_G1.float().mean())}
