"""A training session: forward-backward of Datum rows under a registered loss, optimizer steps, state and export."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gspo_core.config import GSPOConfig
from gspo_core.datum_losses import LossInputs, config_for, merge_metrics
from gspo_core.distributed import (
    broadcast,
    gather,
    gather_state_dict,
    join_group,
    lead_writer,
    load_sharded,
    local_device,
    most,
    save_sharded,
    shard,
)
from gspo_core.packing import PackedBatch
from gspo_core.policy import autocast_dtype, base_model, load_policy
from gspo_core.primitives.core import PolicyState, loss_backward, optimizer_update
from gspo_core.primitives.types import AdamParams, Datum, ForwardBackwardOutput, LoraSpec
from gspo_core.registry import DATUM_LOSSES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Tokens one forward-backward holds at most: a call over more runs as micro-batches (the losses are sums
#: over rows, so their gradients add up to the one-batch ones).
MICRO_BATCH_TOKENS = 16_384


def datum_batch(data: list[Datum], pad_id: int) -> PackedBatch:
    """Rows as one forward batch over all their positions: ``T`` is the longest row's length, each position
    predicting its own target token."""
    width = max(len(datum.tokens) for datum in data)
    input_BT = torch.full((len(data), width), pad_id, dtype=torch.long)
    target_BT = torch.full((len(data), width), pad_id, dtype=torch.long)
    attn_BT = torch.zeros((len(data), width), dtype=torch.long)
    for row, datum in enumerate(data):
        input_BT[row, : len(datum.tokens)] = torch.tensor(datum.tokens)
        target_BT[row, : len(datum.tokens)] = torch.tensor(datum.target_tokens)
        attn_BT[row, : len(datum.tokens)] = 1
    pos_BT = torch.arange(width).expand(len(data), width).clone()
    return PackedBatch(input_BT, attn_BT, pos_BT, target_BT, attn_BT.float())


def loss_inputs(data: list[Datum], device: torch.device) -> LossInputs:
    """The rows' per-position loss inputs, padded with 0 to the longest row."""
    width = max(len(datum.tokens) for datum in data)

    def padded(name: str) -> torch.Tensor:
        out_BT = torch.zeros(len(data), width)
        for row, datum in enumerate(data):
            values = getattr(datum, name)
            if values is not None:
                out_BT[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return out_BT.to(device)

    mask_BT = torch.zeros(len(data), width, device=device)
    for row, datum in enumerate(data):
        mask_BT[row, : len(datum.tokens)] = 1.0
    adv_BT = padded("advantages")
    given_BT = padded("mask")
    no_mask = torch.tensor([datum.mask is None for datum in data], device=device).unsqueeze(-1)
    ratio_mask_BT = torch.where(no_mask, (adv_BT != 0).float(), given_BT) * mask_BT
    return LossInputs(mask_BT, padded("weights"), padded("logprobs"), adv_BT, ratio_mask_BT)


def micro_batches(data: list[Datum], budget: int) -> list[list[Datum]]:
    """Rows in order as runs of at most ``budget`` tokens each (a longer row alone)."""
    parts: list[list[Datum]] = [[]]
    tokens = 0
    for datum in data:
        if parts[-1] and tokens + len(datum.tokens) > budget:
            parts.append([])
            tokens = 0
        parts[-1].append(datum)
        tokens += len(datum.tokens)
    return parts


class TrainingSession:
    """A model in training: every call is one primitive (a forward-backward, an optimizer step, a save), each
    going through the code path the GSPO job loop's update takes (`gspo_core.primitives.core`).

    On N ranks (FSDP2 over torchrun's group) rank 0 is the session its caller drives, and every public call
    first hands its name and arguments to the other ranks, which run :meth:`follow` until rank 0 closes; each
    call then runs on every rank, each on its share of the rows. No call tests the rank: what rank 0 alone
    writes goes through the session's ``writer``, which does nothing on the other ranks.
    """

    def __init__(self, policy: PolicyState, tokenizer: PreTrainedTokenizerBase, micro_batch_tokens: int) -> None:
        self.policy, self.tokenizer, self.micro_batch_tokens = policy, tokenizer, micro_batch_tokens
        self.writer = lead_writer(policy.ranks)
        self.steps = 0

    @classmethod
    def create(
        cls,
        model_path: str,
        *,
        lora: LoraSpec | None = None,
        seed: int = 0,
        device: str | None = None,
        micro_batch_tokens: int = MICRO_BATCH_TOKENS,
        precision: str = "auto",
    ) -> TrainingSession:
        """Load ``model_path`` (a local HF directory or a hub id) for full fine-tuning, or with ``lora``'s adapter;
        under torchrun, on every rank (each its shards)."""
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        lora_fields: dict[str, object] = {}
        if lora is not None:
            if lora.rank < 1:
                raise ValueError("lora.rank: must be at least 1")
            lora_fields = {"lora_rank": lora.rank, "lora_alpha": float(lora.alpha or lora.rank)}
            if lora.target_modules:
                lora_fields["lora_target_modules"] = list(lora.target_modules)
        cfg = GSPOConfig.model_validate({"seed": seed, "precision": precision, **lora_fields})
        torch_device = torch.device(device) if device else local_device()
        ranks = join_group(torch_device)
        model, tokenizer = load_policy(model_path, cfg, torch_device)
        amp = autocast_dtype(cfg, torch_device)
        sharded = shard(model, torch_device, amp, ranks)
        # After sharding: the optimizer takes each rank's shards.
        params = [param for param in model.parameters() if param.requires_grad]
        fused = all(param.device.type in ("cpu", "cuda") for param in params)
        optimizer = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=fused)
        policy = PolicyState(model, optimizer, None, amp, tokenizer.pad_token_id, sharded, ranks)
        return cls(policy, tokenizer, micro_batch_tokens)

    # --- the calls rank 0's caller makes -------------------------------------------------------------------

    def forward(self, data: list[Datum], loss: str, loss_config: dict | None = None) -> ForwardBackwardOutput:
        """The loss and log-probs of ``data`` by the current weights, with no gradient."""
        self._check(data, loss, loss_config)
        return self._lead("_run", data, loss, loss_config, False)

    def forward_backward(self, data: list[Datum], loss: str, loss_config: dict | None = None) -> ForwardBackwardOutput:
        """The same, and the loss's gradient added to those of earlier calls since the last :meth:`optim_step`."""
        self._check(data, loss, loss_config)
        return self._lead("_run", data, loss, loss_config, True)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """One AdamW step with ``adam``'s settings over the gradients accumulated since the last; zeroes them."""
        if adam.learning_rate < 0 or not 0 <= adam.beta1 < 1 or not 0 <= adam.beta2 < 1 or adam.eps < 0:
            raise ValueError(f"adam: invalid settings {adam}")
        return self._lead("_optim_step", adam)

    def save_state(self, path: str, *, optimizer: bool = True) -> None:
        """The trainable weights (and the optimizer's state) under ``path``, each rank its shards."""
        self._lead("_save_state", path, optimizer)

    def load_state(self, path: str, *, optimizer: bool = True) -> None:
        """Weights (and the optimizer's state) saved by :meth:`save_state`, at any number of ranks."""
        if not (Path(path) / "trainer" / ".metadata").is_file():
            raise FileNotFoundError(f"path: {path} holds no saved training state")
        self._lead("_load_state", path, optimizer)

    def export_hf(self, path: str) -> None:
        """A Hugging Face directory transformers and vLLM load as is (LoRA: merged, the adapter in ``adapter/``)."""
        self._lead("_export_hf", path)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's full state dict (its own names) on rank 0, gathered from every rank's shards."""
        return self._lead("_full_state")

    def close(self) -> None:
        """Drop the optimizer's state and the gradients, and release the other ranks from :meth:`follow`."""
        self._lead("_close")

    def _check(self, data: list[Datum], loss: str, loss_config: dict | None) -> None:
        """Refuse a call rank 0's caller got wrong before any rank runs it, naming the field."""
        loss_fn = _loss(loss)
        config_for(loss_fn, loss_config)
        if not data:
            raise ValueError("data: empty")
        vocab_size = base_model(self.policy.model).get_input_embeddings().weight.shape[0]
        for index, datum in enumerate(data):
            datum.check(index, vocab_size)
            for name in loss_fn.needs:
                if getattr(datum, name) is None:
                    raise ValueError(f"data[{index}].{name}: this loss needs it")

    # --- every rank ----------------------------------------------------------------------------------------

    def _lead(self, name: str, *args):
        """Rank 0: hand the call to the other ranks (they run it too), then run it."""
        if self.policy.ranks.world > 1:
            broadcast((name, args), self.policy.ranks)
        return getattr(self, name)(*args)

    def follow(self) -> None:
        """Ranks 1..N-1: run rank 0's calls as they come, until it closes the session."""
        while True:
            call: tuple[str, tuple] = broadcast(None, self.policy.ranks)
            name, args = call
            getattr(self, name)(*args)
            if name == "_close":
                return

    def _run(self, data: list[Datum], loss: str, loss_config: dict | None, backward: bool) -> ForwardBackwardOutput:
        """Each rank its contiguous share of the rows, a micro-batch at a time; every rank runs as many forwards
        (they are collective), a rank out of rows on a stand-in row whose loss counts 0."""
        loss_fn, policy = _loss(loss), self.policy
        config = config_for(loss_fn, loss_config)
        share = torch.tensor_split(torch.arange(len(data)), policy.ranks.world)[policy.ranks.rank].tolist()
        parts = [part for part in micro_batches([data[i] for i in share], self.micro_batch_tokens) if part]
        parts += [[]] * (most(len(parts), policy.ranks) - len(parts))
        metrics: dict[str, float] = {}
        logprobs: list[list[float]] = []
        for part in parts:
            rows = part or data[:1]
            batch = datum_batch(rows, policy.pad_id).to(policy.device)
            inputs = loss_inputs(rows, policy.device)

            def loss_of(logp_BT, inputs=inputs):
                return loss_fn(logp_BT, inputs, config)

            if backward:
                done = loss_backward(policy, batch, loss_of, scale=1.0 if part else 0.0)
                logp_BT, part_metrics = done.logp_BT, done.metrics
            else:
                with torch.no_grad():
                    logp_BT = policy.logprobs(batch, 1.0)
                    part_metrics = loss_of(logp_BT)[1]
            if part:
                merge_metrics(metrics, part_metrics)
                logprobs += [logp_BT[row, : len(d.tokens)].float().cpu().tolist() for row, d in enumerate(part)]
        everyone = gather((logprobs, metrics), policy.ranks)  # in rank order: the shares are contiguous
        merged: dict[str, float] = {}
        for _, rank_metrics in everyone:
            merge_metrics(merged, rank_metrics)
        return ForwardBackwardOutput(logprobs=[row for rank_rows, _ in everyone for row in rank_rows], metrics=merged)

    def _optim_step(self, adam: AdamParams) -> dict[str, float]:
        for group in self.policy.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        grad_norm = optimizer_update(self.policy, adam.grad_clip_norm or float("inf"))
        self.steps += 1
        return {"grad_norm": grad_norm, "learning_rate": adam.learning_rate}

    def _save_state(self, path: str, optimizer: bool) -> None:
        save_sharded(self.policy.model, self.policy.optimizer, Path(path) / "trainer", with_optimizer=optimizer)
        self.writer.save({"steps": self.steps}, Path(path) / "session.pt")

    def _load_state(self, path: str, optimizer: bool) -> None:
        load_sharded(self.policy.model, self.policy.optimizer, Path(path) / "trainer", with_optimizer=optimizer)
        if optimizer:
            self.steps = int(torch.load(Path(path) / "session.pt")["steps"])

    def _export_hf(self, path: str) -> None:
        state = gather_state_dict(self.policy.model)
        self.writer.export(self.policy.model, self.tokenizer, Path(path), state, adapter_dir=Path(path) / "adapter")

    def _full_state(self) -> dict[str, torch.Tensor]:
        return gather_state_dict(self.policy.model)

    def _close(self) -> None:
        self.policy.optimizer.state.clear()
        self.policy.optimizer.zero_grad(set_to_none=True)


def _loss(name: str):
    try:
        return DATUM_LOSSES.get(name)
    except KeyError:
        raise ValueError(f"loss: unknown {name!r}; known: {', '.join(DATUM_LOSSES.names())}") from None
