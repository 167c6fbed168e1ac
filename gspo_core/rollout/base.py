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
    ``max_tokens_each``: a cap per prompt (each at most ``max_tokens``), where the prompts' budgets differ
    (the later turns of multi-turn episodes); None: ``max_tokens`` for all.
    ``greedy``: the most likely token at each position (evaluation), whatever ``temperature`` and ``top_p``.
    ``stop_token_ids``: tokens that end a completion as EOS does (kept in it; finish reason ``stop``).
    """

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True
    max_tokens_each: tuple[int, ...] | None = None
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def cap(self, prompt_index: int) -> int:
        """The most tokens prompt ``prompt_index`` may sample."""
        return self.max_tokens if self.max_tokens_each is None else self.max_tokens_each[prompt_index]


@dataclass(frozen=True)
class EnvironmentScore:
    """A verifiers environment's own score of an episode: its rubric's ``reward`` (None: none) and metrics;
    graders read them as ``sample.environment`` (the ``verifiers`` grader)."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeOutcome:
    """How an episode that an environment ran with its own transcript ended (a user's agent, an OpenEnv server,
    a verifiers environment). ``reward``: the one the environment reported (None: the job's grader gives it);
    ``error``: why the episode was dropped (None: it was not); ``session``: the agent session's id;
    ``prefix_breaks``: the agent's requests that rewrote its history; ``seed`` and ``step_rewards``: an OpenEnv
    episode's reset seed and each step's reward (None: the server gave none); ``score``: a verifiers
    environment's."""

    reward: float | None = None
    error: str | None = None
    session: str = ""
    prefix_breaks: int = 0
    seed: int | None = None
    step_rewards: tuple[float | None, ...] = ()
    score: EnvironmentScore | None = None


@dataclass(frozen=True)
class EpisodeInfo:
    """What a multi-turn episode adds to its completion: ``turns`` (model turns), ``tool_calls`` (OpenAI's
    shape, every turn's), ``messages`` (the transcript: each turn's assistant text, tool calls and tool results;
    an environment's own transcript whole) and ``outcome`` (None: the job's tools ran it, not an environment of
    its own)."""

    turns: int
    tool_calls: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    outcome: EpisodeOutcome | None = None


@dataclass
class Completion:
    """One sampled completion.

    ``logprobs[t]`` is the sampler's log-probability of ``completion_ids[t]`` (same length), or
    ``[]`` when the spec did not ask for them.
    ``finish_reason`` is ``"stop"`` (EOS or stop string) or ``"length"`` (hit max_tokens).
    ``text`` is ``completion_ids`` decoded on their own, special tokens skipped (as TRL and verl decode
    completions), whichever engine sampled them; for a multi-turn episode, the last turn's (the final answer).
    ``mask``: for a multi-turn episode (`gspo_core.agents`), 1 on the ids the model sampled and 0 on those
    the environment added (tool results, template glue), one per ``completion_ids``; the loss, the ratio,
    the entropy and the lengths count only the 1s. Empty: every completion id was sampled (one turn).
    At environment positions ``logprobs`` holds 0. ``dropped``: a tool of the episode failed for good
    (`gspo_core.agents.tools.ToolResult.drop`): the row trains nothing (``trained_mask`` all 0) and is not
    graded. ``discarded_tokens``: tokens the model sampled for the episode that the row no longer holds (an
    agent rewrote its history, so the row starts anew); not trained, but sampled, so usage counts them.
    ``episode``: what a multi-turn episode (tool calls, an agent, an environment) adds (`EpisodeInfo`); None
    for a single completion.
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    episode: EpisodeInfo | None = None
    mask: list[int] = field(default_factory=list)
    dropped: bool = False
    discarded_tokens: int = 0

    @property
    def sampled_mask(self) -> list[int]:
        """1 on each completion id the model sampled, 0 on the environment's (see ``mask``)."""
        return self.mask or [1] * len(self.completion_ids)

    @property
    def trained_mask(self) -> list[int]:
        """The mask the update uses: ``mask`` (empty: all sampled), or all 0 for a dropped episode."""
        return [0] * len(self.completion_ids) if self.dropped else self.mask

    @property
    def sampled_tokens(self) -> int:
        """How many of ``completion_ids`` the model sampled."""
        return sum(self.mask) if self.mask else len(self.completion_ids)


class WeightSink(Protocol):
    """What the trainer pushes its new weights to after each optimizer step: rank 0's engine, or another
    rank's side of a push every rank takes part in (`gspo_core.rollout.weight_push.Push`)."""

    #: True when the engine samples with the trainer's own parameters (nothing to push).
    shares_weights: bool
    #: The weight-transfer backend its pushes use (`gspo_core.rollout.weight_push`); "" when nothing is pushed.
    push_backend: str

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with HF-named tensors (no restart, no disk) and drop caches."""
        ...

    def wake(self) -> None:
        """Undo :meth:`RolloutEngine.sleep`."""
        ...


class RolloutEngine(WeightSink, Protocol):
    """A sampler whose weights the trainer can replace in place after each optimizer step."""

    name: str

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """Return ``sampling.n`` completions for each prompt, in prompt order."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory during the update where the platform supports it (else no-op)."""
        ...

    def close(self) -> None:
        """Release the engine."""
        ...
