"""One GSPO step as a one-way pipeline of phases, each taking values and returning values.

`gspo_core.gspo_loop.gspo_step` calls them in this order, each timed as ``time/<phase>``:

1. ``rollout``: :func:`sample` -- ``P`` prompts, ``G`` completions each: a `Rollout` of ``N = P * G``
   rows, each prompt's group contiguous.
2. ``reward``: :func:`score` -- every row's reward: `Scores`.
3. ``advantages``: :func:`advantages` -- the registered estimator over the rewards (``adv_N``), and
   :func:`plan_minibatches` -- the update's `MinibatchPlan` (split, order, zero-advantage rows left out),
   made once.
4. ``old_logprobs``: :func:`old_logprobs` -- the old policy's log-probs of the rows the update reads:
   `OldLogprobs`.
5. ``train``: :func:`update` -- ``mini_batches`` optimizer updates: `UpdateResult`, which also says whether
   the sampler's log-probs failed their check (``old_logprobs=auto``); the job keeps that decision.
6. ``weight_sync``: :func:`push_weights` -- the new weights into the rollout engine.

No phase changes what an earlier one returned; the policy's training state (model, optimizer, LR
schedule, autocast, pad id) travels as one `PolicyState`.

Naming: a tensor's name ends with its shape, one capital letter per dimension, each letter meaning the same
in every gspo_core file:

* ``P`` prompts (of a step, of a generate call, or a batch's distinct ones), ``G`` completions per prompt
  (the group size), ``N`` rollout rows (``N = P * G``), ``B`` rows of one forward batch (a mini-batch, a
  micro-batch, or a generate call's rows);
* ``T`` completion positions, ``L`` positions of a whole row (prompt and completion, or a prompt alone);
* ``F`` token positions flattened out of ``[B, T]`` (``F = B * T``), ``C`` a chunk or a subset of them;
* ``V`` vocabulary, ``H`` hidden size; ``1`` a dimension of size 1 kept for broadcasting.

So ``logp_BT`` is ``[B, T]``, ``adv_N`` is ``[N]`` and ``rewards_PG`` is ``[P, G]``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from gspo_core import advantages as _advantages  # noqa: F401  (registers the estimators)
from gspo_core.agents.episodes import EpisodeSettings, run_episodes
from gspo_core.batching import lengths_N, micro_batches, minibatches  # noqa: F401  (micro_batches: tests read it here)
from gspo_core.config import GSPOConfig
from gspo_core.policy import Policy, checkpoint_weights, export_weights
from gspo_core.primitives.core import PolicyState  # noqa: F401  (the step's policy state, by its old name)
from gspo_core.registry import ADVANTAGES
from gspo_core.rewards import sample_for, transcript_sample
from gspo_core.rollout.base import Completion, RolloutEngine, SamplingSpec, WeightSink
from gspo_core.stopping import NEVER, StopCheck
from gspo_core.update import (  # noqa: F401  (phases 4 and 5, read here as the step's map names them)
    MinibatchPlan,
    OldLogprobs,
    UpdateResult,
    _has_sampler_logprobs,
    old_logprobs,
    recompute_old_logprobs,
    update,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.rewards import GradeResult, RewardFunction


@dataclass(frozen=True)
class Rollout:
    """A step's flattened rollout: ``N = prompts * group_size`` sequences (episodes), groups contiguous, and
    the episodes' metrics (`gspo_core.agents.run_episodes`; none for one-turn rollouts)."""

    rows: list[dict]
    prompts: list[str]
    completions: list[Completion]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Scores:
    """Rewards of a rollout's rows (``rewards_N``), each row's grades, and the reward metrics."""

    rewards_N: torch.Tensor
    grades: list[GradeResult]
    metrics: dict[str, float]


class Timer(dict[str, float]):
    """Accumulates wall time per phase into ``time/<phase>`` metrics."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self[f"time/{name}"] = self.get(f"time/{name}", 0.0) + time.perf_counter() - start


# --- 1. rollout ---------------------------------------------------------------------------------------------


def old_logprob_mode(cfg: GSPOConfig, sampler_trusted: bool = True) -> str:
    """The old-logprob source a step uses: ``cfg.old_logprobs``, but ``auto`` turns to ``recompute`` once a
    check of the sampler's log-probs failed (``sampler_trusted`` False: trainer state, see :func:`update`)."""
    return "recompute" if cfg.old_logprobs == "auto" and not sampler_trusted else cfg.old_logprobs


def sampler_logprobs_needed(cfg: GSPOConfig, step: int, mode: str | None = None) -> bool:
    """Whether step ``step`` (1-based) asks the sampler for logprobs: always when they serve as the
    old policy's (``mode``, default ``cfg.old_logprobs``), else on the first step and every
    ``logprob_gap_every`` steps, for the gap metrics. (With one mini-batch ``auto`` needs none: every
    row's old logprobs come from its on-policy forward.)"""
    mode, every = mode or cfg.old_logprobs, cfg.logprob_gap_every
    return (
        mode == "rollout"
        or (mode == "auto" and cfg.mini_batches > 1)
        or (every > 0 and (step == 1 or step % every == 0))
    )


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Each prompt's token ids, left-truncated to ``max_prompt_tokens`` (an empty prompt: the BOS token)."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"] if prompts else []
    return [prompt[-max_prompt_tokens:] or [tokenizer.bos_token_id or 0] for prompt in ids]


def sample(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    prompts: list[str],
    cfg: GSPOConfig,
    seed: int,
    n: int | None = None,
    logprobs: bool = True,
    agent: EpisodeSettings | None = None,
    greedy: bool = False,
    stop: StopCheck = NEVER,
) -> Rollout:
    """``n`` (default ``group_size``) episodes per prompt, prompts left-truncated to ``max_prompt_tokens``;
    ``logprobs``: also the sampler's per-token logprobs; ``agent``: the job's turns and tools (None: one
    turn, no tools); ``greedy``: the most likely tokens instead of samples (evaluation); ``stop``: ends the
    rollout early (`StepStopped`)."""
    prompt_ids = prompt_token_ids(tokenizer, prompts, cfg.max_prompt_tokens)
    spec = SamplingSpec(
        n=n or cfg.group_size,
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        ignore_eos=cfg.ignore_eos,
        seed=seed,
        logprobs=logprobs,
        greedy=greedy,
    )
    groups, metrics = run_episodes(engine, tokenizer, prompt_ids, spec, agent or EpisodeSettings(), rows, stop)
    return Rollout(rows, prompts, [completion for group in groups for completion in group], metrics)


# --- 2. reward ----------------------------------------------------------------------------------------------


def score(reward_fn: RewardFunction, rollout: Rollout, stop: StopCheck = NEVER) -> Scores:
    """Rewards of every completion, with reward and grader-error metrics. A dropped episode is not graded: it
    takes the mean reward of its group's other episodes (advantage about 0; it trains nothing anyway).
    ``stop``: ends the wait for the graders early (`StepStopped`)."""
    from gspo_core.rewards import GradeResult

    given = {i: _agent_reward(c) for i, c in enumerate(rollout.completions) if _agent_reward(c) is not None}
    kept = [i for i, c in enumerate(rollout.completions) if not c.dropped and i not in given]
    items = [rollout.rows[rollout.completions[i].prompt_index] for i in kept]
    samples = [
        grader_sample(rollout.completions[i], rollout.prompts[rollout.completions[i].prompt_index]) for i in kept
    ]
    graded = dict(zip(kept, reward_fn.score_batch(items, samples, stop) if kept else [], strict=True))
    graded.update({i: GradeResult(cast(float, r)) for i, r in given.items() if not rollout.completions[i].dropped})
    grades = [graded.get(i) or _dropped_grade(rollout, i, graded) for i in range(len(rollout.completions))]
    rewards_N = torch.tensor([grade.reward for grade in grades], dtype=torch.float32)
    metrics = {"reward/mean": float(rewards_N.mean()), "reward/std": float(rewards_N.std(unbiased=False))}
    for name in reward_fn.grader_names:
        metrics[f"reward/{name}/mean"] = sum(grade.scores.get(name, 0.0) for grade in grades) / len(grades)
        metrics[f"grader_errors/{name}"] = float(sum(name in grade.errors for grade in grades))
    return Scores(rewards_N=rewards_N, grades=grades, metrics=metrics)


def _agent_reward(completion: Completion) -> float | None:
    """The reward the user's agent reported for its episode (None: the job's grader gives it)."""
    episode = completion.episode
    return episode.outcome.reward if episode is not None and episode.outcome is not None else None


def grader_sample(completion: Completion, prompt: str) -> dict:
    """What graders see as ``sample``: the final answer, the sampled tokens and the finish reason; for an
    episode with tool calls also ``output_tools`` (OpenAI's shape) and ``messages`` (the transcript: an
    agent's episode, its own whole; else after the prompt as a user message), read from the transcript as
    the API's dry runs read a given one (`gspo_core.rewards.transcript_sample`)."""
    episode = completion.episode
    if episode is not None and episode.outcome is not None:
        sample = sample_for(
            completion.text, completion.sampled_tokens, completion.finish_reason, episode.tool_calls, episode.messages
        )
        score = episode.outcome.score
        if score is not None:  # a verifiers environment's episode: its scores (the `verifiers` grader)
            sample["environment"] = {"reward": score.reward, "metrics": score.metrics}
        return sample
    answer = [{"role": "assistant", "content": completion.text}]
    messages = [{"role": "user", "content": prompt}, *(episode.messages if episode is not None else answer)]
    return transcript_sample(messages, completion.sampled_tokens, completion.finish_reason)


def _dropped_grade(rollout: Rollout, row: int, graded: dict[int, GradeResult]) -> GradeResult:
    from gspo_core.rewards import GradeResult

    group = rollout.completions[row].prompt_index
    peers = [g.reward for i, g in graded.items() if rollout.completions[i].prompt_index == group]
    why = {"episode": "dropped: a tool or the agent failed"}
    return GradeResult(reward=sum(peers) / len(peers) if peers else 0.0, errors=why)


# --- 3. advantages and the mini-batch plan ------------------------------------------------------------------


def advantages(rewards_N: torch.Tensor, cfg: GSPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """``adv_N`` of the registered estimator ``cfg.advantage``, and its metrics."""
    return ADVANTAGES.get(cfg.advantage)(rewards_N, cfg.group_size, scale=cfg.scale_rewards)


def plan_minibatches(
    rollout: Rollout, adv_N: torch.Tensor, cfg: GSPOConfig, generator: torch.Generator
) -> MinibatchPlan:
    """The update's `MinibatchPlan`: ``cfg.mini_batches`` mini-batches in ``cfg.minibatch_order``, drawn
    from ``generator``, less the zero-advantage rows of the later ones."""
    batches = minibatches(
        lengths_N(rollout.completions),
        cfg.mini_batches,
        cfg.minibatch_order,
        generator,
        cfg.group_size,
        keep_groups=cfg.share_prompts and not cfg.gradient_checkpointing,
    )
    live = [batch if k == 0 else _with_signal(batch, adv_N) for k, batch in enumerate(batches)]
    return MinibatchPlan(batches=tuple(batches), live=tuple(live))


def _with_signal(idx: torch.Tensor, adv_N: torch.Tensor) -> torch.Tensor:
    """The rows of ``idx`` whose advantage is not exactly 0 (per-token advantages: not all 0)."""
    adv = adv_N[idx]
    return idx[(adv != 0) if adv.dim() == 1 else (adv != 0).any(-1)]


# --- 4. old log-probs and 5. train: gspo_core.update -----------------------------------------------------


# --- 6. weight sync, and what a step reports ----------------------------------------------------------------


def push_weights(model: Policy, engine: WeightSink, state: dict[str, torch.Tensor] | None = None) -> None:
    """Hand the new weights (``state``: the model's full state dict, default its own) to an engine that keeps
    its own copy (vLLM), or to a rank's side of a push every rank takes part in; no-op otherwise."""
    if not engine.shares_weights:
        engine.load_weights(checkpoint_weights(model, export_weights(model, state)))


def completion_metrics(rollout: Rollout) -> dict[str, float]:
    """Lengths (the tokens the model sampled: an episode's environment tokens are not counted) and the
    truncated share."""
    lengths = [completion.sampled_tokens for completion in rollout.completions]
    truncated = sum(completion.finish_reason == "length" for completion in rollout.completions)
    return {
        "completion/len_mean": sum(lengths) / len(lengths),
        "completion/len_max": float(max(lengths)),
        "completion/truncated_frac": truncated / len(lengths),
        **rollout.metrics,
    }


def sample_rows(rollout: Rollout, scores: Scores, cfg: GSPOConfig) -> list[dict]:
    """The first ``samples_per_step`` prompts with all their completions, rewards and grader errors; an
    episode with tool calls also gives its ``turns``, ``messages`` (each turn: assistant text, tool calls,
    tool results), ``trained_tokens`` (its sampled ids) and ``dropped``."""
    rows = []
    group_size = cfg.group_size
    for prompt_index in range(min(cfg.samples_per_step, len(rollout.prompts))):
        group = slice(prompt_index * group_size, (prompt_index + 1) * group_size)
        completions = []
        for completion, grade in zip(rollout.completions[group], scores.grades[group], strict=True):
            completions.append(
                {
                    "text": completion.text,
                    "reward": grade.reward,
                    "scores": grade.scores,
                    "errors": grade.errors,
                    "tokens": len(completion.completion_ids),
                    "finish_reason": completion.finish_reason,
                    **_episode_fields(completion),
                }
            )
        rows.append(
            {"prompt": rollout.prompts[prompt_index], "item": rollout.rows[prompt_index], "completions": completions}
        )
    return rows


def _episode_fields(completion: Completion) -> dict:
    if completion.episode is None:
        return {}
    return {
        "turns": completion.episode.turns,
        "messages": completion.episode.messages,
        "trained_tokens": sum(completion.trained_mask),
        "dropped": completion.dropped,
    }
