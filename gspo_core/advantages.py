"""Advantage estimators as pure tensor functions, registered by name."""

from __future__ import annotations

import torch

from gspo_core.registry import ADVANTAGES


@ADVANTAGES.register("group_norm")
def group_norm(rewards_N: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6):
    """Group-relative advantages ``A_i = (r_i - mean_group) / (std_group + eps)``.

    ``rewards_N`` holds ``N = P * G`` rewards (``P`` prompts, ``G = group_size`` each), each group contiguous.
    With ``scale=False`` the std division is skipped (Dr. GRPO style). Returns ``(adv_N, metrics)``
    where ``reward/frac_zero_std`` is the fraction of groups whose rewards are all equal: they carry
    no learning signal, and their advantages are exactly 0 (``r - mean`` alone would leave float
    rounding, e.g. up to 0.1 for twelve rewards of 0.7 divided by ``std + eps``, a push in an
    arbitrary direction; exact zeros also let the update skip those rows).
    """
    if rewards_N.dim() != 1 or rewards_N.numel() % group_size:
        raise ValueError(
            f"rewards_N: expected a flat tensor of groups of {group_size}, got shape {tuple(rewards_N.shape)}"
        )
    rewards_PG = rewards_N.float().view(-1, group_size)
    mean_P1 = rewards_PG.mean(-1, keepdim=True)
    std_P1 = rewards_PG.std(-1, keepdim=True, unbiased=False)
    adv_PG = rewards_PG - mean_P1
    if scale:
        adv_PG = adv_PG / (std_P1 + eps)
    tied_P1 = (rewards_PG == rewards_PG[:, :1]).all(-1, keepdim=True)
    adv_PG = adv_PG.masked_fill(tied_P1, 0.0)
    return adv_PG.reshape(-1), {"reward/frac_zero_std": float(tied_P1.float().mean())}
