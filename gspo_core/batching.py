"""Rows into batches: the update's mini-batch split, micro-batches within a token budget, packed forwards."""

from __future__ import annotations

import torch

from gspo_core.config import GSPOConfig
from gspo_core.packing import pack_rows
from gspo_core.rollout.base import Completion


def lengths_N(comps: list[Completion]) -> torch.Tensor:
    """Prompt + completion tokens of each rollout row ``[N]``."""
    return torch.tensor([len(c.prompt_ids) + len(c.completion_ids) for c in comps])


def minibatches(
    lengths_N: torch.Tensor, k: int, order: str, gen: torch.Generator, group_size: int = 1
) -> list[torch.Tensor]:
    """Split ``N`` rollout rows (groups of ``group_size`` contiguous) into ``k`` mini-batches of
    indices, each row exactly once.

    ``random``: a random permutation. ``group``: whole groups in random order (each prompt then runs
    once per mini-batch, see :mod:`gspo_core.packing`). ``length``: rows sorted by ``lengths_N`` so
    each mini-batch pads only to lengths close to its own (docs/bench.md measured the padding of both),
    ties in ``group`` order; the batches' order is random.
    """
    perm = torch.randperm(len(lengths_N), generator=gen)
    if order == "random":
        return list(perm.chunk(k))
    group_rank_G = torch.randperm(-(-len(lengths_N) // group_size), generator=gen)
    by_group = perm[torch.sort(group_rank_G[perm // group_size], stable=True).indices]
    if order == "group":
        return list(by_group.chunk(k))
    by_len = by_group[torch.sort(lengths_N[by_group], stable=True).indices]
    chunks = list(by_len.chunk(k))
    return [chunks[i] for i in torch.randperm(len(chunks), generator=gen)]


def micro_batches(comps: list[Completion], idx: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Rows ``idx``, in order, as runs of at most ``budget`` tokens (prompt + completion) each, a row over
    the budget alone; ``budget`` 0: all in one."""
    if budget <= 0 or not len(idx):
        return [idx]
    parts: list[list[int]] = [[]]
    tokens = 0
    for i, n in zip(idx.tolist(), lengths_N(comps)[idx].tolist()):
        if parts[-1] and tokens + n > budget:
            parts.append([])
            tokens = 0
        parts[-1].append(i)
        tokens += n
    return [torch.tensor(p, dtype=torch.long) for p in parts]


def pack(comps: list[Completion], idx, pad_id: int, cfg: GSPOConfig):
    """Rows ``idx`` as one forward batch; rows of one prompt share its pass where that pays
    (``cfg.share_prompts``; not with gradient checkpointing, which drops the prompt's KV cache)."""
    return pack_rows(
        [comps[i].prompt_ids for i in idx],
        [comps[i].completion_ids for i in idx],
        pad_id,
        share=cfg.share_prompts and not cfg.gradient_checkpointing,
    )
