"""The rollout-engine contract: what every sampler (vLLM, transformers) takes and returns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: ``n`` completions per prompt of at most ``max_tokens`` tokens.

    ``logprobs``: return the sampler's per-token logprobs. Asking slows vLLM's sampling (docs/bench.md),
    so the trainer asks only when it uses them.
    """

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True


@dataclass
class Completion:
    """One sampled completion.

    ``logprobs[t]`` is the sampler's log-probability of ``completion_ids[t]`` (same length), or
    ``[]`` when the spec did not ask for them.
    ``finish_reason`` is ``"stop"`` (EOS or stop string) or ``"length"`` (hit max_tokens).
    ``text`` is ``completion_ids`` decoded on their own, special tokens skipped (as TRL and verl decode
    completions), whichever engine sampled them.
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    extra: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    """A sampler whose weights the trainer can replace in place after each optimizer step."""

    name: str
    #: True when the engine samples with the trainer's own parameters (nothing to push).
    shares_weights: bool

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """Return ``sampling.n`` completions for each prompt, in prompt order."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with HF-named tensors (no restart, no disk) and drop caches."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory during the update where the platform supports it (else no-op)."""
        ...

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        ...

    def close(self) -> None:
        """Release the engine."""
        ...
