"""A training session: forward-backward of Datum rows under a registered loss, optimizer steps, state and export."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gspo_core.config import GSPOConfig
from gspo_core.datum_losses import LossInputs, config_for, merge_metrics
from gspo_core.distributed import join_group, load_sharded, save_sharded, shard
from gspo_core.packing import PackedBatch
from gspo_core.policy import autocast_dtype, load_policy, save_hf
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
    going through the code path the GSPO job loop's update takes (`gspo_core.primitives.core`)."""

    def __init__(self, policy: PolicyState, tokenizer: PreTrainedTokenizerBase, micro_batch_tokens: int) -> None:
        self.policy, self.tokenizer, self.micro_batch_tokens = policy, tokenizer, micro_batch_tokens
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
        """Load ``model_path`` (a local HF directory or a hub id) for full fine-tuning, or with ``lora``'s adapter."""
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        lora_fields: dict[str, object] = {}
        if lora is not None:
            lora_fields = {"lora_rank": lora.rank, "lora_alpha": float(lora.alpha or lora.rank)}
            if lora.target_modules:
                lora_fields["lora_target_modules"] = list(lora.target_modules)
        cfg = GSPOConfig.model_validate({"seed": seed, "precision": precision, **lora_fields})
        torch_device = torch.device(device) if device else _default_device()
        ranks = join_group(torch_device)
        model, tokenizer = load_policy(model_path, cfg, torch_device)
        amp = autocast_dtype(cfg, torch_device)
        sharded = shard(model, torch_device, amp, ranks)
        params = [param for param in model.parameters() if param.requires_grad]
        fused = all(param.device.type in ("cpu", "cuda") for param in params)
        optimizer = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=fused)
        policy = PolicyState(model, optimizer, None, amp, tokenizer.pad_token_id, sharded, ranks)
        return cls(policy, tokenizer, micro_batch_tokens)

    def forward(self, data: list[Datum], loss: str, loss_config: dict | None = None) -> ForwardBackwardOutput:
        """The loss and log-probs of ``data`` by the current weights, with no gradient."""
        with torch.no_grad():
            return self._run(data, loss, loss_config, backward=False)

    def forward_backward(self, data: list[Datum], loss: str, loss_config: dict | None = None) -> ForwardBackwardOutput:
        """The same, and the loss's gradient added to those of earlier calls since the last :meth:`optim_step`."""
        return self._run(data, loss, loss_config, backward=True)

    def _run(self, data: list[Datum], loss: str, loss_config: dict | None, backward: bool) -> ForwardBackwardOutput:
        loss_fn = _loss(loss)
        config = config_for(loss_fn, loss_config)
        _check(data, loss_fn)
        policy = self.policy
        metrics: dict[str, float] = {}
        logprobs: list[list[float]] = []
        for part in micro_batches(data, self.micro_batch_tokens):
            batch = datum_batch(part, policy.pad_id).to(policy.device)
            inputs = loss_inputs(part, policy.device)

            def loss_of(logp_BT, inputs=inputs):
                return loss_fn(logp_BT, inputs, config)

            if backward:
                done = loss_backward(policy, batch, loss_of)
                logp_BT, part_metrics = done.logp_BT, done.metrics
            else:
                logp_BT = policy.logprobs(batch, 1.0)
                part_metrics = loss_of(logp_BT)[1]
            merge_metrics(metrics, part_metrics)
            logprobs += [logp_BT[row, : len(datum.tokens)].float().cpu().tolist() for row, datum in enumerate(part)]
        return ForwardBackwardOutput(logprobs=logprobs, metrics=metrics)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """One AdamW step with ``adam``'s settings over the gradients accumulated since the last; zeroes them."""
        if adam.learning_rate < 0 or not 0 <= adam.beta1 < 1 or not 0 <= adam.beta2 < 1 or adam.eps < 0:
            raise ValueError(f"adam: invalid settings {adam}")
        for group in self.policy.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        grad_norm = optimizer_update(self.policy, adam.grad_clip_norm or float("inf"))
        self.steps += 1
        return {"grad_norm": grad_norm, "learning_rate": adam.learning_rate}

    def save_state(self, path: str, *, optimizer: bool = True) -> None:
        """The trainable weights (and the optimizer's state) under ``path``, each rank its shards."""
        save_sharded(self.policy.model, self.policy.optimizer, Path(path) / "trainer", with_optimizer=optimizer)
        torch.save({"steps": self.steps}, Path(path) / "session.pt")

    def load_state(self, path: str, *, optimizer: bool = True) -> None:
        """Weights (and the optimizer's state) saved by :meth:`save_state`, at any number of ranks."""
        if not (Path(path) / "trainer" / ".metadata").is_file():
            raise FileNotFoundError(f"path: {path} holds no saved training state")
        load_sharded(self.policy.model, self.policy.optimizer, Path(path) / "trainer", with_optimizer=optimizer)
        if optimizer:
            self.steps = int(torch.load(Path(path) / "session.pt")["steps"])

    def export_hf(self, path: str) -> None:
        """A Hugging Face directory transformers and vLLM load as is (LoRA: merged, the adapter in ``adapter/``)."""
        from gspo_core.distributed import gather_state_dict

        state = gather_state_dict(self.policy.model)
        if self.policy.ranks.main:
            save_hf(self.policy.model, self.tokenizer, Path(path), state, adapter_dir=Path(path) / "adapter")

    def close(self) -> None:
        """Drop the optimizer's state and the gradients (the model goes with the session's last reference)."""
        self.policy.optimizer.state.clear()
        self.policy.optimizer.zero_grad(set_to_none=True)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _loss(name: str):
    try:
        return DATUM_LOSSES.get(name)
    except KeyError:
        raise ValueError(f"loss: unknown {name!r}; known: {', '.join(DATUM_LOSSES.names())}") from None


def _check(data: list[Datum], loss_fn) -> None:
    if not data:
        raise ValueError("data: empty")
    for index, datum in enumerate(data):
        datum.check(index)
        for name in loss_fn.needs:
            if getattr(datum, name) is None:
                raise ValueError(f"data[{index}].{name}: this loss needs it")
