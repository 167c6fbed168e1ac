"""Rows into batches: the update's mini-batch split, micro-batches within a token budget, packed forwards."""

from __future__ import annotations

import torch

from gspo_core.config import GSPOConfig
from gspo_core.packing import PackedBatch, SharedPrefixBatch, pack_rows
from gspo_core.rollout.base import Completion


def lengths_N(completions: list[Completion]) -> torch.Tensor:
    """Prompt + completion tokens of each rollout row ``[N]``."""
    return torch.tensor([len(completion.prompt_ids) + len(completion.completion_ids) for completion in completions])


def minibatches(
    lengths_N: torch.Tensor,
    n_batches: int,
    order: str,
    generator: torch.Generator,
    group_size: int = 1,
    keep_groups: bool = False,
) -> list[torch.Tensor]:
    """Split ``N`` rollout rows (groups of ``group_size`` contiguous) into ``n_batches`` mini-batches of
    indices, each row exactly once.

    ``random``: a random permutation. ``group``: whole groups in random order (each prompt then runs
    once per mini-batch, see :mod:`gspo_core.packing`). ``length``: rows sorted by ``lengths_N`` so
    each mini-batch pads only to lengths close to its own (docs/bench.md measured the padding of both),
    ties in ``group`` order; the batches' order is random. With ``keep_groups`` (the trainer's forwards
    share prompts), ``length`` sorts whole groups by their longest row instead: sorting rows scatters a
    group whose completions differ in length over every mini-batch, and its prompt then runs once per
    row instead of once per mini-batch (twice the forward tokens of a chat job, docs/bench.md).
    """
    perm_N = torch.randperm(len(lengths_N), generator=generator)
    if order == "random":
        return list(perm_N.chunk(n_batches))
    group_N = torch.arange(len(lengths_N)) // group_size
    group_rank_P = torch.randperm(int(group_N[-1]) + 1 if len(group_N) else 0, generator=generator)
    by_group_N = perm_N[torch.sort(group_rank_P[group_N[perm_N]], stable=True).indices]
    if order == "group":
        return list(by_group_N.chunk(n_batches))
    key_N = lengths_N
    if keep_groups and group_size > 1:
        longest_P = torch.zeros(len(group_rank_P), dtype=lengths_N.dtype).scatter_reduce(
            0, group_N, lengths_N, "amax", include_self=False
        )
        key_N = longest_P[group_N]
    by_length_N = by_group_N[torch.sort(key_N[by_group_N], stable=True).indices]
    chunks = list(by_length_N.chunk(n_batches))
    return [chunks[i] for i in torch.randperm(len(chunks), generator=generator)]


#: Micro-batch budgets where a job leaves ``micro_batch_tokens`` unset (`GSPOConfig`'s comment says why).
CPU_MICRO_BATCH_TOKENS = 1024
GPU_MICRO_BATCH_TOKENS = 16_384


def micro_batch_budget(tokens: int | None, device: torch.device) -> int:
    """The job's ``micro_batch_tokens``, or the default of ``device``'s type where it is unset."""
    if tokens is not None:
        return tokens
    return CPU_MICRO_BATCH_TOKENS if device.type == "cpu" else GPU_MICRO_BATCH_TOKENS


def micro_batches(completions: list[Completion], idx: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Rows ``idx``, in order, as runs of at most ``budget`` tokens (prompt + completion) each, a row over
    the budget alone; ``budget`` 0: all in one."""
    if budget <= 0 or not len(idx):
        return [idx]
    parts: list[list[int]] = [[]]
    tokens = 0
    for row, length in zip(idx.tolist(), lengths_N(completions)[idx].tolist(), strict=True):
        if parts[-1] and tokens + length > budget:
            parts.append([])
            tokens = 0
        parts[-1].append(row)
        tokens += length
    return [torch.tensor(part, dtype=torch.long) for part in parts]


def pack(
    completions: list[Completion], idx: torch.Tensor, pad_id: int, cfg: GSPOConfig, share: bool = True
) -> PackedBatch | SharedPrefixBatch:
    """Rows ``idx`` as one forward batch; rows of one prompt share its pass where that pays
    (``share`` and ``cfg.share_prompts``; not with gradient checkpointing, which drops the prompt's KV cache)."""
    return pack_rows(
        [completions[i].prompt_ids for i in idx],
        [completions[i].completion_ids for i in idx],
        pad_id,
        share=share and cfg.share_prompts and not cfg.gradient_checkpointing,
        masks=[completions[i].trained_mask for i in idx],
    )
