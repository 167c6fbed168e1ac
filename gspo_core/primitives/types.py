"""The primitives' records: a training row, what a forward-backward returns, optimizer and sampling settings."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Datum:
    """One row, Tinker-shaped: position ``i`` of ``tokens`` predicts ``target_tokens[i]`` (the same length).

    ``weights``: cross_entropy's per-position weights (0 on prompt positions). ``logprobs``: the sampler's
    log-probs of ``target_tokens`` (0 where it did not sample). ``advantages``: per-position advantages (0 on
    prompt and environment positions). ``mask``: 1 on the positions the sampler produced, over which the
    sequence-level losses (``gspo``, ``gspo_token``) take their ratio (Tinker's ``sequence_ratio_mask``);
    None: the positions whose advantage is not 0.
    """

    tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    mask: list[float] | None = None

    def check(self, index: int, vocab_size: int) -> None:
        """Refuse a row whose per-position lists do not match its tokens, whose token ids are not the model's,
        or whose numbers are not finite, naming the field."""
        if not self.tokens:
            raise ValueError(f"data[{index}].tokens: empty")
        for name in ("tokens", "target_tokens"):
            if any(not 0 <= token < vocab_size for token in getattr(self, name)):
                raise ValueError(f"data[{index}].{name}: token ids must lie in [0, {vocab_size})")
        for name in ("target_tokens", "weights", "logprobs", "advantages", "mask"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.tokens):
                raise ValueError(f"data[{index}].{name}: {len(values)} values for {len(self.tokens)} tokens")
            if name != "target_tokens" and values is not None and not all(math.isfinite(v) for v in values):
                raise ValueError(f"data[{index}].{name}: values must be finite")


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per datum, per position: the log-prob of ``target_tokens`` under the current policy; and the loss's
    metrics, each named with how it adds up over calls and ranks (``loss:sum``, ``ratio:min``, ...)."""

    logprobs: list[list[float]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's AdamW settings (decoupled weight decay); ``grad_clip_norm`` 0: no clipping."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter: ``rank``, ``alpha`` (None: ``rank``, a scaling of 1) and the module names it adapts
    (None: the job loop's default, the attention projections: `GSPOConfig.lora_target_modules`)."""

    rank: int
    alpha: float | None = None
    target_modules: tuple[str, ...] | None = None

    @classmethod
    def of_parts(cls, rank: int, *, attention: bool = True, mlp: bool = True, unembed: bool = True) -> LoraSpec:
        """An adapter on the parts Tinker's ``LoraConfig`` names (``train_attn``, ``train_mlp``,
        ``train_unembed``, all on by default there): the projections of Llama-family models (Llama, Qwen,
        SmolLM2, the toy models). A head tied to the input embeddings gets none (`gspo_core.policy.lora_targets`)."""
        parts = ((attention, ATTENTION_MODULES), (mlp, MLP_MODULES), (unembed, UNEMBED_MODULES))
        modules = tuple(name for wanted, names in parts if wanted for name in names)
        if not modules:
            raise ValueError("lora: train_attn, train_mlp and train_unembed are all off; nothing to adapt")
        return cls(rank=rank, target_modules=modules)


ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


@dataclass(frozen=True)
class SampledSequence:
    """One sampled continuation: its tokens, the sampler's log-prob of each, and why it ended
    (``stop``: an end-of-sequence token or a stop sequence; ``length``: ``max_tokens``)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: at most ``max_tokens`` tokens; ``top_k`` -1: no top-k cut; ``stop``: strings or token
    ids that end a sequence (kept in it, as the sampler produced them); ``ignore_eos``: the end-of-sequence
    token does not end one (``max_tokens`` each: fixed-length work, as benchmarks ask)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | list[int] | None = None
    ignore_eos: bool = False
