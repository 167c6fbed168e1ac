"""One GSPO step as a one-way pipeline of phases, each taking values and returning values.

`gspo_core.trainer.Trainer.run_step` calls them in this order, each timed as ``time/<phase>``:

1. ``rollout``: :func:`sample` -- ``P`` prompts, ``G`` completions each: a `Rollout` of ``N = P * G``
   rows, each prompt's group contiguous.
2. ``reward``: :func:`score` -- every row's reward: `Scores`.
3. ``advantages``: :func:`advantages` -- the registered estimator over the rewards (``adv_N``), and
   :func:`plan_minibatches` -- the update's `MinibatchPlan` (split, order, zero-advantage rows left out),
   made once.
4. ``old_logprobs``: :func:`old_logprobs` -- the old policy's log-probs of the rows the update reads:
   `OldLogprobs`.
5. ``train``: :func:`update` -- ``mini_batches`` optimizer updates: `UpdateResult`, which also says whether
   the sampler's log-probs failed their check (``old_logprobs=auto``); the trainer keeps that decision.
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
from gspo_core.batching import lengths_N, micro_batches, minibatches, pack
from gspo_core.config import GSPOConfig
from gspo_core.distributed import Ranks, clip_grad_norm, everywhere, gather, merge_loss_metrics, most
from gspo_core.losses import LossMetrics
from gspo_core.packing import PackedBatch, SharedPrefixBatch
from gspo_core.policy import Policy, checkpoint_weights, completion_logprobs, export_weights
from gspo_core.registry import ADVANTAGES, LOSSES
from gspo_core.rewards import sample_for, transcript_sample
from gspo_core.rollout.base import Completion, RolloutEngine, SamplingSpec, WeightSink
from gspo_core.stopping import NEVER, StopCheck

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


@dataclass(frozen=True)
class MinibatchPlan:
    """The update's mini-batches, drawn once per step: ``batches[k]`` the rows of mini-batch ``k`` (every
    rollout row exactly once, in update order), ``live[k]`` those of them that run forward and backward.

    Rows of mini-batches after the first whose advantage is exactly 0 (groups whose rewards all tie) are
    left out of ``live``: every registered loss is a sum of per-row terms times the row's advantage, with no
    KL, so their gradient is exactly 0 and the update is the same. Mini-batch 0 keeps every row: its
    forward is on-policy and gives the trainer-vs-sampler metrics over all of them.
    """

    batches: tuple[torch.Tensor, ...]
    live: tuple[torch.Tensor, ...]

    @property
    def skipped(self) -> int:
        """Rows left out of the forward and backward."""
        return sum(len(batch) - len(live) for batch, live in zip(self.batches, self.live, strict=True))

    def later_live_rows(self) -> torch.Tensor:
        """The rows whose old log-probs the update reads from `OldLogprobs` (mini-batch 0's come from its own
        on-policy forward): the live rows of the later mini-batches (none with one mini-batch)."""
        return torch.cat(self.live[1:]) if len(self.live) > 1 else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class OldLogprobs:
    """The old policy's log-probs ``logp_NT`` ``[N, T]`` (0 on padding and on rows the update never reads).

    ``first_on_policy``: mini-batch 0 takes its own forward's detached log-probs instead (it runs before any
    optimizer step, so they are exactly the old policy's). ``verify``: these are the sampler's, accepted only
    if they pass the check on that forward (``old_logprobs=auto``, see :func:`update`).
    """

    logp_NT: torch.Tensor
    first_on_policy: bool
    verify: bool = False


@dataclass
class PolicyState:
    """The policy's training state: the model, its optimizer and LR schedule, the autocast dtype of its
    forwards (None: fp32), and the pad token id of its batches. In the trainer the model is sharded over
    ``ranks`` and ``sharded`` is its FSDP root (`gspo_core.distributed.ShardedPolicy`), whose forward is
    :func:`completion_logprobs`; each rank runs its share of every batch's rows."""

    model: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    amp: torch.dtype | None
    pad_id: int
    sharded: torch.nn.Module | None = None
    ranks: Ranks = field(default_factory=lambda: Ranks(0, 1))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logprobs(self, batch, temperature: float, with_entropy: bool = False):
        """:func:`completion_logprobs` of ``batch`` by the current weights (through the FSDP root when sharded)."""
        if self.sharded is not None:
            return self.sharded(batch, temperature, self.amp, with_entropy)
        if with_entropy:
            return completion_logprobs(self.model, batch, temperature, self.amp, with_entropy=True)
        return completion_logprobs(self.model, batch, temperature, self.amp)

    def pack(
        self, completions: list[Completion], idx: torch.Tensor, cfg: GSPOConfig
    ) -> PackedBatch | SharedPrefixBatch:
        """Rows ``idx`` as one forward batch (`gspo_core.batching.pack`), on the policy's device. The ranks' forwards
        must call the same modules in the same order (FSDP gathers each as it runs): the rows share prompt
        passes only where every rank's do."""
        batch = pack(completions, idx, self.pad_id, cfg)
        if not everywhere(isinstance(batch, SharedPrefixBatch), self.ranks):
            batch = pack(completions, idx, self.pad_id, cfg, share=False)
        return batch.to(self.device)

    def share(self, rows_B: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of ``rows_B`` (all of them on one rank)."""
        return torch.tensor_split(rows_B, self.ranks.world)[self.ranks.rank]


@dataclass(frozen=True)
class UpdateResult:
    """What :func:`update` did: its metrics, the old log-probs it used (recomputed ones where the
    sampler's failed their check), and whether they failed (the trainer then stops trusting the sampler)."""

    metrics: dict[str, float]
    old: OldLogprobs
    sampler_rejected: bool = False


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
    return (completion.extra.get("agent") or {}).get("reward")


def grader_sample(completion: Completion, prompt: str) -> dict:
    """What graders see as ``sample``: the final answer, the sampled tokens and the finish reason; for an
    episode with tool calls also ``output_tools`` (OpenAI's shape) and ``messages`` (the transcript: an
    agent's episode, its own whole; else after the prompt as a user message), read from the transcript as
    the API's dry runs read a given one (`gspo_core.rewards.transcript_sample`)."""
    turns = completion.extra.get("messages")
    if "agent" in completion.extra:
        sample = sample_for(
            completion.text,
            completion.sampled_tokens,
            completion.finish_reason,
            completion.extra.get("tool_calls", []),
            turns or [],
        )
        agent = completion.extra["agent"]
        if "environment_reward" in agent:  # a verifiers environment's episode: its scores (the `verifiers` grader)
            sample["environment"] = {"reward": agent["environment_reward"], "metrics": agent["environment_metrics"]}
        return sample
    answer = [{"role": "assistant", "content": completion.text}]
    messages = [{"role": "user", "content": prompt}, *(turns if turns is not None else answer)]
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


# --- 4. old log-probs ---------------------------------------------------------------------------------------

#: Token budget of one no-grad forward: the whole rollout goes in one batch unless it is larger.
OLD_LOGPROBS_TOKENS_PER_FORWARD = 65_536


def old_logprobs(
    policy: PolicyState, rollout: Rollout, plan: MinibatchPlan, cfg: GSPOConfig, mode: str | None = None
) -> OldLogprobs:
    """The old policy's log-probs of the rows the update reads, by ``mode`` (default ``cfg.old_logprobs``;
    the trainer passes :func:`old_logprob_mode`).

    ``rollout``: the sampler's own. ``auto``: the sampler's too, to be checked by :func:`update` against
    mini-batch 0's on-policy forward. ``recompute`` (and ``auto`` with one mini-batch or without sampler
    logprobs): batched no-grad forwards of :meth:`MinibatchPlan.later_live_rows` -- mini-batch 0's come
    from the update's own first forward, which runs before any optimizer step (a quarter of the pass saved
    at 4 mini-batches), and zero-advantage rows are never read.
    """
    mode = mode or cfg.old_logprobs
    completions = rollout.completions
    if mode == "rollout" or (mode == "auto" and len(plan.batches) > 1 and _has_sampler_logprobs(completions)):
        logp_NT = torch.zeros(len(completions), _width(completions))
        for row, completion in enumerate(completions):
            logp_NT[row, : len(completion.logprobs)] = torch.tensor(completion.logprobs, dtype=torch.float32)
        return OldLogprobs(logp_NT, first_on_policy=mode == "auto", verify=mode == "auto")
    return recompute_old_logprobs(policy, rollout, plan, cfg)


def recompute_old_logprobs(policy: PolicyState, rollout: Rollout, plan: MinibatchPlan, cfg: GSPOConfig) -> OldLogprobs:
    """Old log-probs of the later mini-batches' live rows by the current weights, in batched no-grad
    forwards (split only past :data:`OLD_LOGPROBS_TOKENS_PER_FORWARD` tokens)."""
    completions, rows = rollout.completions, plan.later_live_rows()
    logp_NT = torch.zeros(len(completions), _width(completions))
    if len(rows):
        mine = policy.share(rows)  # each rank its share; every rank runs as many forwards (they are collective)
        tokens = int(lengths_N(completions)[mine].sum())
        forwards = most(max(1, -(-tokens // OLD_LOGPROBS_TOKENS_PER_FORWARD)), policy.ranks)
        with torch.inference_mode():
            for idx in torch.tensor_split(mine, forwards):
                batch = policy.pack(completions, idx if len(idx) else rows[:1], cfg)
                logp_BT = policy.logprobs(batch, cfg.temperature)
                if len(idx):
                    logp_NT[idx, : logp_BT.size(1)] = (logp_BT.float() * batch.mask_BT).cpu()
        for theirs, their_NT in gather((mine, logp_NT[mine]), policy.ranks):
            logp_NT[theirs] = their_NT
    return OldLogprobs(logp_NT, first_on_policy=True)


def _width(completions: list[Completion]) -> int:
    return max(1, max(len(completion.completion_ids) for completion in completions))


def _has_sampler_logprobs(completions: list[Completion]) -> bool:
    return all(len(completion.logprobs) == len(completion.completion_ids) for completion in completions)


# --- 5. train -----------------------------------------------------------------------------------------------


def update(
    policy: PolicyState,
    rollout: Rollout,
    old: OldLogprobs,
    adv_N: torch.Tensor,
    plan: MinibatchPlan,
    cfg: GSPOConfig,
) -> UpdateResult:
    """``cfg.mini_batches`` optimizer updates over the rollout with the registered loss, one per mini-batch
    of ``plan`` (a mini-batch over ``cfg.micro_batch_tokens`` accumulates its gradient over micro-batches;
    a mini-batch left empty still steps AdamW, with zero gradients).

    Mini-batch 0's forward runs before any optimizer step, so it is on-policy: it gives the trainer-vs-sampler
    gap metrics, and, with ``old.verify`` (``old_logprobs=auto``), the check of the sampler's log-probs. A
    check that fails recomputes the later mini-batches' old log-probs right there, while the weights are
    still the ones that sampled (:func:`recompute_old_logprobs`), and the result says so
    (``sampler_rejected``): the step is then exactly a ``recompute`` step.
    """
    # The optimizer's own: a sharded module's registered parameters are the gathered ones after a no-grad forward.
    params = [param for group in policy.optimizer.param_groups for param in group["params"]]
    per_update: dict[str, list[float]] = {}
    extra: dict[str, float] = {}
    rejected = False
    for k, (rows, live) in enumerate(zip(plan.batches, plan.live, strict=True)):
        policy.optimizer.zero_grad(set_to_none=True)
        if len(live):
            metrics, logp_BT, mask_BT = _minibatch_grads(
                policy, rollout, old, adv_N, live, len(rows), cfg, first=k == 0
            )
            if logp_BT is not None and mask_BT is not None:
                # Mini-batch 0: on-policy, before the optimizer step: a failed check can still recompute in time.
                extra.update(_sampler_gap(logp_BT, [rollout.completions[i] for i in live], mask_BT))
                if old.verify:
                    err = _sampler_error(old.logp_NT[live], logp_BT, mask_BT)
                    rejected = err > cfg.rollout_logprob_tol
                    if rejected:
                        old = recompute_old_logprobs(policy, rollout, plan, cfg)
                    extra.update({"old_logprobs/sampler_err_max": err, "old_logprobs/recomputed": float(rejected)})
        else:
            metrics = {"loss": 0.0}
            for param in params:
                param.grad = torch.zeros_like(param)
        grad_norm = clip_grad_norm(params, cfg.max_grad_norm)
        extra["lr"] = policy.optimizer.param_groups[0]["lr"]  # the rate this update used
        policy.optimizer.step()
        policy.scheduler.step()
        for name, value in {**metrics, "grad_norm": float(grad_norm)}.items():
            per_update.setdefault(name, []).append(value)
    means = {name: sum(values) / len(values) for name, values in per_update.items()}
    means["ratio/min"], means["ratio/max"] = min(per_update["ratio/min"]), max(per_update["ratio/max"])
    means["update/rows_skipped_frac"] = plan.skipped / len(rollout.completions)
    return UpdateResult(metrics={**means, **extra}, old=old, sampler_rejected=rejected)


def _minibatch_grads(
    policy: PolicyState,
    rollout: Rollout,
    old: OldLogprobs,
    adv_N: torch.Tensor,
    rows: torch.Tensor,
    n_rows: int,
    cfg: GSPOConfig,
    first: bool,
) -> tuple[dict[str, float], torch.Tensor | None, torch.Tensor | None]:
    """Forward and backward of this rank's share of the live ``rows`` of a mini-batch of ``n_rows`` rows, a
    micro-batch of ``cfg.micro_batch_tokens`` at a time, each loss scaled as a share of the mean over all
    ``n_rows`` rows (left-out rows and other ranks' rows add 0 here), so the gradients of all micro-batches of
    all ranks add up to the one-batch ones. The metrics come from these same loss evaluations
    (`gspo_core.losses.LossMetrics`), added up over the ranks. Returns ``(metrics, logp_BT, mask_BT)``; for
    mini-batch 0 (``first``) also the detached log-probs and mask ``[len(rows), T]`` of all ``rows`` (every
    rank's), on the CPU (else None, None)."""
    loss_fn = LOSSES.get(cfg.loss)
    on_policy = first and old.first_on_policy
    width = old.logp_NT.size(1)
    mine = policy.share(rows)
    logp_BT = torch.zeros(len(mine), width) if first else None
    mask_BT = torch.zeros(len(mine), width) if first else None
    metrics, filled = LossMetrics(loss_fn, n_rows), 0
    micros = [part for part in micro_batches(rollout.completions, mine, cfg.micro_batch_tokens) if len(part)]
    # Forwards and backwards are collective: a rank with fewer micro-batches runs the rest on a stand-in row
    # with a zero loss scale (a zero gradient).
    micros += [rows[:0]] * (most(len(micros), policy.ranks) - len(micros))
    for micro_rows in micros:
        scale = len(micro_rows) / n_rows
        batch = policy.pack(rollout.completions, micro_rows if len(micro_rows) else rows[:1], cfg)
        micro_logp_BT, entropy = policy.logprobs(batch, cfg.temperature, with_entropy=True)
        device, stand_in = micro_logp_BT.device, micro_rows if len(micro_rows) else rows[:1]
        old_BT = micro_logp_BT.detach() if on_policy else old.logp_NT[stand_in][:, : micro_logp_BT.size(1)].to(device)
        loss, loss_metrics = loss_fn(
            micro_logp_BT, old_BT, adv_N[stand_in].to(device), batch.mask_BT, cfg.clip_eps_low, cfg.clip_eps_high
        )
        (loss * scale).backward()
        if not len(micro_rows):
            continue
        metrics.add(loss, loss_metrics, entropy, batch.mask_BT, len(micro_rows))
        if logp_BT is not None and mask_BT is not None:  # first
            span, micro_width = slice(filled, filled + len(micro_rows)), micro_logp_BT.size(1)
            logp_BT[span, :micro_width] = micro_logp_BT.detach().cpu()
            mask_BT[span, :micro_width] = batch.mask_BT.cpu()
        filled += len(micro_rows)
    if logp_BT is not None and mask_BT is not None:  # the ranks' shares are contiguous, in rank order
        logp_BT, mask_BT = (torch.cat(part) for part in zip(*gather((logp_BT, mask_BT), policy.ranks), strict=True))
    return merge_loss_metrics(metrics, policy.ranks).result(), logp_BT, mask_BT


def _sampler_error(sampler_BT: torch.Tensor, logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """``old_logprobs=auto``'s check: the largest per-sequence error in ``log s_i`` the sampler's log-probs
    ``sampler_BT`` would cause, measured against mini-batch 0's on-policy forward ``logp_BT``."""
    sampler_BT = sampler_BT[:, : logp_BT.size(1)].to(logp_BT.device)
    err_B = ((logp_BT - sampler_BT) * mask_BT).sum(-1).abs() / mask_BT.sum(-1).clamp(min=1)
    return float(err_B.max()) if err_B.numel() else 0.0


def _sampler_gap(logp_BT: torch.Tensor, completions: list[Completion], mask_BT: torch.Tensor) -> dict[str, float]:
    """Trainer-vs-sampler logprob gap on an on-policy forward, when the sampler returned its own."""
    if not _has_sampler_logprobs(completions):
        return {}  # not asked for this step (sampler_logprobs_needed)
    sampler_BT = torch.zeros_like(mask_BT)
    for row, completion in enumerate(completions):
        sampler_BT[row, : len(completion.logprobs)] = torch.tensor(completion.logprobs, dtype=sampler_BT.dtype)
    gap_BT = (logp_BT - sampler_BT).abs() * mask_BT
    return {
        "logprob_gap/mean": float(gap_BT.sum() / mask_BT.sum().clamp(min=1)),
        "logprob_gap/max": float(gap_BT.max()),
    }


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
    if "turns" not in completion.extra:
        return {}
    return {
        "turns": completion.extra["turns"],
        "messages": completion.extra["messages"],
        "trained_tokens": sum(completion.trained_mask),
        "dropped": completion.dropped,
    }
