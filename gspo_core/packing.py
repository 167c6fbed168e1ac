"""Rollout rows as batches for the trainer's forward: right-padded rows, or each prompt run once for its rows.

A step's rows come in groups of ``G`` completions of one prompt. Run as plain rows, every row
recomputes its prompt: ``G`` times the prompt's work, forward and backward. A
:class:`SharedPrefixBatch` runs each distinct prompt once, indexes its KV cache out to its rows and
runs only their completions on top; the backward sums the rows' gradients into the one prompt pass.
Same values and gradients up to fp32 rounding (tests/core/test_packing.py); the saving is the
prompt share of the tokens times ``(G - 1) / G`` -- small for 9-token prompts, most of the update for
RL prompts of hundreds of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

#: Share prompts only where that removes at least this fraction of a batch's tokens: below it the second
#: trunk call and its small-batch kernels cost about what they save (docs/bench.md: prompt sharing).
SHARE_MIN_SAVED = 0.25


def _to(obj, device):
    return type(obj)(**{f.name: getattr(obj, f.name).to(device, non_blocking=True) for f in fields(obj)})


@dataclass
class PackedBatch:
    """Right-padded ``[prompt | completion]`` rows and where each completion token sits.

    ``input_BL``/``attn_BL``: token ids and attention mask. ``pos_BT``: index of the hidden state
    that predicts completion token t of row b. ``target_BT``/``mask_BT``: completion tokens and 1
    on real (not padded) ones the model sampled (0 on padding and on an episode's environment tokens).
    """

    input_BL: torch.Tensor
    attn_BL: torch.Tensor
    pos_BT: torch.Tensor
    target_BT: torch.Tensor
    mask_BT: torch.Tensor

    def to(self, device) -> PackedBatch:
        return _to(self, device)

    def hidden_BTH(self, trunk) -> torch.Tensor:
        """The trunk's hidden states that predict each completion token ``[B, T, H]``."""
        hidden_BLH = trunk(input_ids=self.input_BL, attention_mask=self.attn_BL, use_cache=False).last_hidden_state
        return hidden_BLH.gather(1, self.pos_BT.unsqueeze(-1).expand(-1, -1, hidden_BLH.size(-1)))


@dataclass
class SharedPrefixBatch:
    """Rows whose prompts repeat, each distinct prompt run once.

    ``prompt_PL``/``prompt_attn_PL``: the ``P`` distinct prompts, left-padded, so every prompt ends at
    the last column and a completion token's distance in the cache to its prompt's tokens is their
    real distance (sliding-window attention masks by that distance); ``prompt_len_P`` their lengths;
    ``row_prompt_B``: the prompt of each row; ``target_BT``/``mask_BT``: the completions (the tokens
    are the targets), right-padded, and 1 on the sampled ones; ``attn_BT``: 1 on every real completion
    token (environment ones included: later tokens attend to them).
    """

    prompt_PL: torch.Tensor
    prompt_attn_PL: torch.Tensor
    prompt_len_P: torch.Tensor
    row_prompt_B: torch.Tensor
    target_BT: torch.Tensor
    mask_BT: torch.Tensor
    attn_BT: torch.Tensor

    def to(self, device) -> SharedPrefixBatch:
        return _to(self, device)

    def hidden_BTH(self, trunk) -> torch.Tensor:
        """``[B, T, H]`` as :meth:`PackedBatch.hidden_BTH`: completion t of row b attends to its prompt's
        real tokens (the padding between is masked) and sits at position ``prompt_len + t`` (RoPE)."""
        from transformers import DynamicCache

        pos_PL = (self.prompt_attn_PL.cumsum(-1) - 1).clamp(min=0)  # positions count real tokens only
        out = trunk(
            input_ids=self.prompt_PL,
            attention_mask=self.prompt_attn_PL,
            position_ids=pos_PL,
            past_key_values=DynamicCache(config=trunk.config),
            use_cache=True,
        )
        cache = out.past_key_values
        cache.reorder_cache(self.row_prompt_B)  # [P, ...] -> [B, ...], differentiable (index_select)
        last_PH = out.last_hidden_state[:, -1]
        T = self.target_BT.size(1)
        pos_BT = self.prompt_len_P[self.row_prompt_B].unsqueeze(1) + torch.arange(T, device=self.prompt_len_P.device)
        attn_BL = torch.cat([self.prompt_attn_PL[self.row_prompt_B], self.attn_BT], dim=1)
        completion_BTH = trunk(
            input_ids=self.target_BT, attention_mask=attn_BL, position_ids=pos_BT, past_key_values=cache, use_cache=True
        ).last_hidden_state
        return torch.cat([last_PH[self.row_prompt_B].unsqueeze(1), completion_BTH[:, :-1]], dim=1)


def _pad_rows(rows: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(row) for row in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, cols] = torch.tensor(row, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def _sampled_BT(completions: list[list[int]], masks: list[list[int]] | None, attn_BT: torch.Tensor) -> torch.Tensor:
    """1 on the completion tokens the model sampled: ``attn_BT`` (real tokens) times each row's ``masks``
    entry (an empty or absent one: every token sampled)."""
    mask_BT = attn_BT.float()
    for row, mask in enumerate(masks or []):
        if mask:
            if len(mask) != len(completions[row]):
                raise ValueError(f"row {row}: mask of {len(mask)} for {len(completions[row])} completion ids")
            mask_BT[row, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return mask_BT


def pack(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, masks: list[list[int]] | None = None
) -> PackedBatch:
    """Build a :class:`PackedBatch` (rows sorted by caller; padding only to the batch's longest);
    ``masks``: each row's sampled-token mask (`gspo_core.rollout.base.Completion.mask`)."""
    input_BL, attn_BL = _pad_rows(
        [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)], pad_id
    )
    target_BT, attn_BT = _pad_rows(completions, pad_id)
    pos_BT = torch.zeros_like(target_BT)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        pos_BT[row, : len(completion)] = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return PackedBatch(input_BL, attn_BL, pos_BT, target_BT, _sampled_BT(completions, masks, attn_BT))


def pack_shared(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, masks: list[list[int]] | None = None
) -> SharedPrefixBatch:
    """Build a :class:`SharedPrefixBatch`: rows with equal prompt tokens share one prompt pass."""
    index: dict[tuple[int, ...], int] = {}
    row_prompt = [index.setdefault(tuple(prompt), len(index)) for prompt in prompts]
    distinct = [list(tokens) for tokens in index]
    prompt_PL, prompt_attn_PL = _pad_rows(distinct, pad_id, left=True)
    target_BT, attn_BT = _pad_rows(completions, pad_id)
    return SharedPrefixBatch(
        prompt_PL,
        prompt_attn_PL,
        torch.tensor([len(prompt) for prompt in distinct]),
        torch.tensor(row_prompt),
        target_BT,
        _sampled_BT(completions, masks, attn_BT),
        attn_BT,
    )


def pack_rows(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    share: bool = True,
    masks: list[list[int]] | None = None,
) -> PackedBatch | SharedPrefixBatch:
    """:func:`pack_shared` where sharing saves at least :data:`SHARE_MIN_SAVED` of the tokens (and every
    row has a prompt and a completion), else :func:`pack`."""
    total = sum(len(prompt) + len(completion) for prompt, completion in zip(prompts, completions, strict=True))
    saved = sum(len(prompt) for prompt in prompts) - sum(len(prompt) for prompt in {tuple(p) for p in prompts})
    if share and saved >= SHARE_MIN_SAVED * total and all(prompts) and all(completions):
        return pack_shared(prompts, completions, pad_id, masks)
    return pack(prompts, completions, pad_id, masks)
