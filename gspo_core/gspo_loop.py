"""The GSPO job's step and evaluation as plain functions over the run's parts: each reads top to bottom, phase by phase.

A step: rows -> :func:`rollout` -> :func:`grade` -> advantages and the mini-batch plan -> old log-probs ->
update (each mini-batch's forward-backward and optimizer step) -> :func:`push_weights` -> metrics and sample
rows, each phase a `gspo_core.step` function taking values and returning values. Evaluation is a loop of
rollout and grade over the held-out rows. The loop around them (checkpoints, resume, evaluations' timing,
callbacks) is `gspo_core.loop`'s, shared with supervised jobs.

Ranks: every rank runs these functions as they read. Rank 0 alone holds the sampler and the graders (None on
the other ranks, set once when the job starts); :func:`shared` is the one place that runs rank 0's part and
hands its result to every rank, as the training primitives' ``follow`` does for their calls.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from gspo_core import step as phases
from gspo_core.config import GSPOConfig
from gspo_core.data import render_prompt
from gspo_core.distributed import Ranks, ShardedPolicy, broadcast, full_weights, gather_state_dict
from gspo_core.primitives.core import PolicyState
from gspo_core.schedule import batch_indices
from gspo_core.stopping import NEVER, StepStopped, StopCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.agents.episodes import EpisodeSettings
    from gspo_core.primitives.sampling import SamplingSession
    from gspo_core.rewards import RewardFunction

T = TypeVar("T")


@dataclass(frozen=True)
class GSPORun:
    """What a GSPO step runs against on this rank: the policy's training state, rank 0's sampler and graders
    (None on the other ranks), the job's turns and tools, how weights reach the sampler, and the stop check of
    the step in flight (rank 0's)."""

    cfg: GSPOConfig
    policy: PolicyState
    #: The policy's FSDP root (`gspo_core.distributed.shard`), gathered whole while an engine samples with it.
    sharded: ShardedPolicy
    tokenizer: PreTrainedTokenizerBase
    #: Rank 0's sampling session over its rollout engine.
    sampler: SamplingSession | None
    reward_fn: RewardFunction | None
    agent: EpisodeSettings | None
    tool_schemas: list[dict] | None
    #: Rank 0's engine samples with the trainer's own (gathered) weights: nothing is pushed.
    engine_shares_weights: bool
    #: How rank 0's engine is pushed to ("": it is not, `gspo_core.rollout.weight_push`).
    push_backend: str
    #: Where this rank's pushes go: rank 0's sampler; on ranks 1..N-1, their side of rank 0's pushes where the
    #: transport takes every rank's copy (CUDA IPC, `gspo_core.rollout.weight_push.PeerEngine`); else None.
    push_to: SamplingSession | None
    stop: StopCheck = NEVER

    @property
    def ranks(self) -> Ranks:
        return self.policy.ranks


@dataclass(frozen=True)
class StepOutcome:
    """What a step returns: its metrics, its sample rows (`gspo_core.step.sample_rows`), and the sampler's
    log-prob error when its log-probs failed their check (``old_logprobs=auto``; None: they passed, or were
    not checked), which the job keeps as its decision for the later steps."""

    metrics: dict[str, float]
    samples: list[dict]
    sampler_rejected_err: float | None = None


def shared(ranks: Ranks, work: Callable[[], T] | None) -> T:
    """Rank 0's result of ``work`` (the other ranks pass None) on every rank; a stop of rank 0's step
    (`StepStopped`) is raised on every rank."""
    outcome: T | StepStopped | None = None
    if work is not None:
        try:
            outcome = work()
        except StepStopped as exc:
            outcome = exc
    value = broadcast(outcome, ranks)
    if isinstance(value, StepStopped):
        raise value
    return cast(T, value)


def step_rows(rows: list[dict], step: int, cfg: GSPOConfig) -> list[dict]:
    """Step ``step``'s prompts: a pure function of (rows, seed, step), so a resumed run draws the same."""
    return [rows[i] for i in batch_indices(len(rows), step, cfg.prompts_per_step, cfg.seed, cfg.shuffle)]


def rollout(
    run: GSPORun, rows: list[dict], seed: int, n: int | None = None, logprobs: bool = True, greedy: bool = False
) -> phases.Rollout:
    """``rows``' prompts sampled by rank 0's sampler (the whole policy gathered on every rank while it does,
    when its engine samples with the trainer's weights); every rank gets the rollout. ``greedy``: the most
    likely completion of each (evaluation)."""
    prompts = [render_prompt(row, run.tokenizer, run.tool_schemas) for row in rows]
    sampler = run.sampler

    def sample() -> phases.Rollout:
        assert sampler is not None
        engine = sampler.engine
        engine.wake()
        try:
            return phases.sample(
                engine, run.tokenizer, rows, prompts, run.cfg, seed, n, logprobs, run.agent, greedy, run.stop
            )
        finally:
            engine.sleep()

    gathered = full_weights(run.sharded) if run.engine_shares_weights else contextlib.nullcontext()
    with gathered:
        return shared(run.ranks, sample if sampler is not None else None)


def grade(run: GSPORun, rollout: phases.Rollout) -> phases.Scores:
    """Every row's reward by rank 0's graders; every rank gets the scores."""
    reward_fn = run.reward_fn
    work = (lambda: phases.score(reward_fn, rollout, run.stop)) if reward_fn is not None else None
    return shared(run.ranks, work)


def push_weights(run: GSPORun) -> None:
    """The new weights into rank 0's sampler (`SamplingSession.push`), gathered from every rank's shards (a
    collective: to rank 0, or to every rank where each sends its copy); nothing to gather for an engine that
    samples with the trainer's own weights."""
    state = None
    if not run.engine_shares_weights:
        from gspo_core.rollout.weight_push import every_rank_sends

        state = gather_state_dict(run.policy.model, everywhere=every_rank_sends(run.push_backend))
    if run.push_to is not None:
        run.push_to.push(run.policy.model, state)


def gspo_step(run: GSPORun, rows: list[dict], step: int, sampler_trusted: bool) -> StepOutcome:
    """One GSPO step (1-based ``step``) on the job's ``rows``, its phases in order, each timed as
    ``time/<phase>``. ``sampler_trusted``: False once the sampler's log-probs failed a check (the job's
    decision): old log-probs are then recomputed."""
    cfg, timer = run.cfg, phases.Timer()
    start = time.perf_counter()
    mode = phases.old_logprob_mode(cfg, sampler_trusted)
    batch = step_rows(rows, step, cfg)
    with timer.phase("rollout"):
        sampled = rollout(
            run, batch, cfg.seed * 100_003 + step, logprobs=phases.sampler_logprobs_needed(cfg, step, mode)
        )
    with timer.phase("reward"):
        scores = grade(run, sampled)
    with timer.phase("advantages"):
        adv_N, adv_metrics = phases.advantages(scores.rewards_N, cfg)
        plan = phases.plan_minibatches(sampled, adv_N, cfg, torch.Generator().manual_seed(cfg.seed * 7919 + step))
    with timer.phase("old_logprobs"):
        old = phases.old_logprobs(run.policy, sampled, plan, cfg, mode)
    with timer.phase("train"):
        result = phases.update(run.policy, sampled, old, adv_N, plan, cfg)
    with timer.phase("weight_sync"):
        push_weights(run)
    timer["time/step"] = time.perf_counter() - start
    metrics = {**scores.metrics, **adv_metrics, **result.metrics, **step_metrics(sampled, timer, step, cfg)}
    rejected = result.metrics["old_logprobs/sampler_err_max"] if result.sampler_rejected else None
    return StepOutcome(metrics, phases.sample_rows(sampled, scores, cfg), rejected)


def step_metrics(sampled: phases.Rollout, timer: phases.Timer, step: int, cfg: GSPOConfig) -> dict[str, float]:
    """The rollout's lengths, the phases' times, the step, throughput and usage counts: completion tokens
    sampled; prompt + completion tokens of the rows the update trained on."""
    # Not tool results; with the tokens an agent's prefix break took out of a row (sampled all the same).
    tokens = sum(c.sampled_tokens + c.discarded_tokens for c in sampled.completions)
    row_tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in sampled.completions)
    return {
        **phases.completion_metrics(sampled),
        **timer,
        "step": float(step),
        "total_steps": float(cfg.steps),
        "throughput/tokens_per_s": tokens / max(timer["time/step"], 1e-9),
        "tokens/sampled": float(tokens),
        "tokens/trained": float(row_tokens),
    }


def evaluate(run: GSPORun, val_rows: list[dict]) -> dict[str, float]:
    """On the validation prompts (the first ``eval_prompts``): the mean reward of one sampled completion each
    (``eval/reward/mean``, with a fixed sampling seed so evaluations of different steps are comparable) and
    of the greedy completion each (``eval/greedy/reward/mean``: greedy accuracy where rewards are 0 or 1),
    with each grader's mean beside them."""
    rows = val_rows[: run.cfg.eval_prompts]
    out = {"eval/prompts": float(len(rows))}
    for prefix, greedy in (("eval", False), ("eval/greedy", True)):
        sampled = rollout(run, rows, seed=run.cfg.seed + 17, n=1, logprobs=False, greedy=greedy)
        metrics = grade(run, sampled).metrics
        out.update(
            {
                f"{prefix}/{name}": value
                for name, value in metrics.items()
                if name.startswith("reward/") and name.endswith("/mean")
            }
        )
    return out
