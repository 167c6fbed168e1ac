"""The update phases of a GSPO step: the old policy's log-probs, and the mini-batches' optimizer updates.

`gspo_core.step` is the map of the whole step; these are its phases 4 (``old_logprobs``) and 5 (``train``), each
mini-batch's forward-backward and optimizer step going through the training primitives' own code
(`gspo_core.primitives.core`: `loss_backward`, `optimizer_update`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo_core.batching import lengths_N, micro_batch_budget, micro_batches
from gspo_core.config import GSPOConfig
from gspo_core.distributed import gather, merge_loss_metrics, most
from gspo_core.losses import LossMetrics
from gspo_core.primitives.core import PolicyState, loss_backward, optimizer_update
from gspo_core.registry import LOSSES
from gspo_core.rollout.base import Completion

if TYPE_CHECKING:
    from gspo_core.step import Rollout


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


@dataclass(frozen=True)
class UpdateResult:
    """What :func:`update` did: its metrics, the old log-probs it used (recomputed ones where the
    sampler's failed their check), and whether they failed (the trainer then stops trusting the sampler)."""

    metrics: dict[str, float]
    old: OldLogprobs
    sampler_rejected: bool = False


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
                    rejected = err > cfg.sampler_tolerance()
                    if rejected:
                        old = recompute_old_logprobs(policy, rollout, plan, cfg)
                    extra.update({"old_logprobs/sampler_err_max": err, "old_logprobs/recomputed": float(rejected)})
        else:
            metrics = {"loss": 0.0}  # an empty mini-batch steps AdamW with zero gradients (optimizer_update)
        extra["lr"] = policy.optimizer.param_groups[0]["lr"]  # the rate this update used
        grad_norm = optimizer_update(policy, cfg.max_grad_norm)
        if policy.scheduler is not None:
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
    budget = micro_batch_budget(cfg.micro_batch_tokens, policy.device)
    micros = [part for part in micro_batches(rollout.completions, mine, budget) if len(part)]
    # Forwards and backwards are collective: a rank with fewer micro-batches runs the rest on a stand-in row
    # with a zero loss scale (a zero gradient).
    micros += [rows[:0]] * (most(len(micros), policy.ranks) - len(micros))
    for micro_rows in micros:
        scale = len(micro_rows) / n_rows
        stand_in = micro_rows if len(micro_rows) else rows[:1]
        batch = policy.pack(rollout.completions, stand_in, cfg)

        def loss_of(logp_BT: torch.Tensor, stand_in: torch.Tensor = stand_in, mask_BT: torch.Tensor = batch.mask_BT):
            device = logp_BT.device
            old_BT = logp_BT.detach() if on_policy else old.logp_NT[stand_in][:, : logp_BT.size(1)].to(device)
            adv = adv_N[stand_in].to(device)
            return loss_fn(logp_BT, old_BT, adv, mask_BT, cfg.clip_eps_low, cfg.clip_eps_high)

        done = loss_backward(policy, batch, loss_of, scale, cfg.temperature)
        if not len(micro_rows):
            continue
        micro_logp_BT = done.logp_BT
        metrics.add(done.loss, done.metrics, done.entropy, batch.mask_BT, len(micro_rows))
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
