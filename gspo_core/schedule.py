"""A run's seeding, its AdamW with the LR schedule, and its data order (a pure function of the step, for resume)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from gspo_core.config import GSPOConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer(
    model: torch.nn.Module, cfg: GSPOConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW + LR schedule over ``steps * mini_batches`` updates (constant or warmup + cosine)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel is the same update in one pass per tensor instead of a handful of kernels per
    # tensor (docs/bench.md).
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay, fused=fused
    )
    total = cfg.steps * cfg.mini_batches
    warmup = cfg.warmup_steps * cfg.mini_batches

    def factor(updates_done: int) -> float:
        if warmup and updates_done < warmup:
            return (updates_done + 1) / warmup
        if cfg.lr_schedule == "cosine":
            progress = (updates_done - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def batch_indices(n_rows: int, step: int, per_step: int, seed: int, shuffle: bool) -> list[int]:
    """Row indices for a 1-based ``step``: a pure function of the step, so resume needs no cursor."""
    indices = []
    for drawn in range((step - 1) * per_step, step * per_step):
        epoch, position = divmod(drawn, n_rows)
        order = list(range(n_rows))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        indices.append(order[position])
    return indices
