"""One GSPO step's phases: rollout, rewards, old logprobs, mini-batch updates, weight push."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gspo_core import advantages as _advantages  # noqa: F401  (registers the estimators)
from gspo_core import losses as _losses  # noqa: F401  (registers the losses)
from gspo_core.config import GSPOConfig
from gspo_core.packing import pack_rows
from gspo_core.policy import completion_logprobs, export_weights
from gspo_core.registry import ADVANTAGES, LOSSES
from gspo_core.rollout.base import Completion, SamplingSpec


@dataclass
class Rollout:
    """A step's flattened rollout: ``N = prompts * group_size`` sequences, groups contiguous."""

    rows: list[dict]
    prompts: list[str]
    completions: list[Completion]
    rewards_N: torch.Tensor = None
    grades: list = field(default_factory=list)
    old_logp_NT: torch.Tensor | None = None
    batches: list[torch.Tensor] | None = None  # the mini-batch split (row indices), once drawn
    first_batch_on_policy: bool = False  # old logprobs of batches[0] come from the update's own forward
    verify_sampler: bool = False  # old_logprobs=auto: old_logp_NT holds the sampler's, checked in update()
    recomputed: bool = False  # auto's check failed: old_logp_NT was recomputed before the first optimizer step
    adv_N: torch.Tensor | None = None  # advantages (see advantages())
    adv_metrics: dict = field(default_factory=dict)


class Timer(dict):
    """Accumulates wall time per phase into ``time/<phase>`` metrics."""

    def phase(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer[f"time/{name}"] = timer.get(f"time/{name}", 0.0) + time.perf_counter() - self.t0

        return _Ctx()


def prompt_token_ids(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Each prompt's token ids, left-truncated to ``max_prompt_tokens`` (an empty prompt: the BOS token)."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"] if prompts else []
    return [x[-max_prompt_tokens:] or [tokenizer.bos_token_id or 0] for x in ids]


def sample(engine, tokenizer, rows, prompts, cfg: GSPOConfig, seed: int, n: int | None = None,
           logprobs: bool = True) -> Rollout:
    """``n`` (default ``group_size``) completions per prompt, prompts left-truncated to ``max_prompt_tokens``;
    ``logprobs``: also the sampler's per-token logprobs."""
    prompt_ids = prompt_token_ids(tokenizer, prompts, cfg.max_prompt_tokens)
    spec = SamplingSpec(n=n or cfg.group_size, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        top_p=cfg.top_p, ignore_eos=cfg.ignore_eos, seed=seed,
                        logprobs=logprobs)
    groups = engine.generate(prompt_ids, spec)
    flat = [c for g in groups for c in g]
    return Rollout(rows=rows, prompts=prompts, completions=flat)


def score(reward_fn, ro: Rollout, cfg: GSPOConfig) -> dict[str, float]:
    """Rewards of every completion; returns reward and grader-error metrics."""
    items = [ro.rows[c.prompt_index] for c in ro.completions]
    samples = [{"output_text": c.text, "output_tokens": len(c.completion_ids), "finish_reason": c.finish_reason}
               for c in ro.completions]
    ro.grades = reward_fn.score_batch(items, samples)
    ro.rewards_N = torch.tensor([g.reward for g in ro.grades], dtype=torch.float32)
    m = {"reward/mean": float(ro.rewards_N.mean()), "reward/std": float(ro.rewards_N.std(unbiased=False))}
    for name in reward_fn.grader_names:
        m[f"reward/{name}/mean"] = sum(g.scores.get(name, 0.0) for g in ro.grades) / len(ro.grades)
        m[f"grader_errors/{name}"] = float(sum(name in g.errors for g in ro.grades))
    return m


def minibatches(lengths_N: torch.Tensor, k: int, order: str, gen: torch.Generator, group_size: int = 1
                ) -> list[torch.Tensor]:
    """Split ``N`` rollout rows (groups of ``group_size`` contiguous) into ``k`` mini-batches of
    indices, each row exactly once.

    ``random``: a random permutation. ``group``: whole groups in random order (each prompt then runs
    once per mini-batch, see :mod:`gspo_core.packing`). ``length``: rows sorted by ``lengths_N`` so
    each mini-batch pads only to lengths close to its own (the GPU benchmark measured 45 % padding
    waste for random batches of mixed lengths, 20 % bucketed), ties in ``group`` order; the batches'
    order is random.
    """
    perm = torch.randperm(len(lengths_N), generator=gen)
    if order == "random":
        return list(perm.chunk(k))
    group_rank_G = torch.randperm(-(-len(lengths_N) // group_size), generator=gen)
    by_group = perm[torch.sort(group_rank_G[perm // group_size], stable=True).indices]
    if order == "group":
        return list(by_group.chunk(k))
    by_len = by_group[torch.sort(lengths_N[by_group], stable=True).indices]
    chunks = list(by_len.chunk(k))
    return [chunks[i] for i in torch.randperm(len(chunks), generator=gen)]


def _lengths_N(comps: list[Completion]) -> torch.Tensor:
    """Prompt + completion tokens of each rollout row ``[N]``."""
    return torch.tensor([len(c.prompt_ids) + len(c.completion_ids) for c in comps])


def _draw_batches(ro: Rollout, cfg: GSPOConfig, gen: torch.Generator) -> None:
    """Draw ``ro.batches`` (the update's mini-batch split) unless it is drawn already."""
    if ro.batches is None:
        ro.batches = minibatches(_lengths_N(ro.completions), cfg.mini_batches, cfg.minibatch_order, gen,
                                 cfg.group_size)


#: Token budget of one no-grad forward: the whole rollout goes in one batch unless it is larger.
OLD_LOGPROBS_TOKENS_PER_FORWARD = 65_536


def sampler_logprobs_needed(cfg: GSPOConfig, step: int) -> bool:
    """Whether step ``step`` (1-based) asks the sampler for logprobs: always when they serve as the
    old policy's, else on the first step and every ``logprob_gap_every`` steps, for the gap metrics.
    (With one mini-batch ``auto`` needs none: every row's old logprobs come from its on-policy forward.)"""
    every = cfg.logprob_gap_every
    return (cfg.old_logprobs == "rollout" or (cfg.old_logprobs == "auto" and cfg.mini_batches > 1)
            or (every > 0 and (step == 1 or step % every == 0)))


def _has_sampler_logprobs(comps: list[Completion]) -> bool:
    return all(len(c.logprobs) == len(c.completion_ids) for c in comps)


def _pack(comps: list[Completion], idx, pad_id: int, cfg: GSPOConfig):
    """Rows ``idx`` as one forward batch; rows of one prompt share its pass where that pays
    (``cfg.share_prompts``; not with gradient checkpointing, which drops the prompt's KV cache)."""
    return pack_rows([comps[i].prompt_ids for i in idx], [comps[i].completion_ids for i in idx], pad_id,
                     share=cfg.share_prompts and not cfg.gradient_checkpointing)


def _recompute(model, ro: Rollout, rows: torch.Tensor, pad_id: int, cfg: GSPOConfig, amp) -> None:
    """Fill ``ro.old_logp_NT[rows]`` with batched no-grad forwards of the current weights (split only
    past :data:`OLD_LOGPROBS_TOKENS_PER_FORWARD` tokens)."""
    if not len(rows):
        return
    comps = ro.completions
    tokens = int(_lengths_N(comps)[rows].sum())
    device = next(model.parameters()).device
    with torch.inference_mode():
        for idx in rows.chunk(max(1, -(-tokens // OLD_LOGPROBS_TOKENS_PER_FORWARD))):
            sub = _pack(comps, idx, pad_id, cfg)
            lp = completion_logprobs(model, sub.to(device), cfg.temperature, amp).float().cpu()
            ro.old_logp_NT[idx, : lp.size(1)] = lp * sub.mask_BT


def old_logprobs(model, ro: Rollout, pad_id: int, cfg: GSPOConfig, amp, gen: torch.Generator | None = None
                 ) -> dict[str, float]:
    """Old-policy logprobs ``ro.old_logp_NT`` ``[N, T]`` (0 on padding).

    ``rollout``: the sampler's own. ``auto``: the sampler's too, marked for :func:`update` to check
    against its first, on-policy forward (``ro.verify_sampler``). ``recompute`` (and ``auto`` without
    a mini-batch split or sampler logprobs): batched no-grad forwards. Given ``gen``, the mini-batch
    split is drawn here (``ro.batches``) and the first mini-batch's rows are left out: the update's
    first forward runs before any optimizer step, so its detached logprobs are exactly the old
    policy's (``ro.first_batch_on_policy``) -- a quarter of the pass saved at 4 mini-batches.
    """
    comps = ro.completions
    if gen is not None:
        _draw_batches(ro, cfg, gen)
    T = max(1, max(len(c.completion_ids) for c in comps))
    ro.old_logp_NT = torch.zeros(len(comps), T)
    auto = cfg.old_logprobs == "auto" and ro.batches is not None and len(ro.batches) > 1
    if cfg.old_logprobs == "rollout" or (auto and _has_sampler_logprobs(comps)):
        for b, c in enumerate(comps):
            ro.old_logp_NT[b, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
        ro.first_batch_on_policy = ro.verify_sampler = cfg.old_logprobs == "auto"
        return {}
    ro.first_batch_on_policy = ro.batches is not None
    if not ro.first_batch_on_policy:
        rows = torch.arange(len(comps))
    else:
        rows = _later_rows_with_signal(ro, cfg)
    _recompute(model, ro, rows, pad_id, cfg, amp)
    return {}


def _check_sampler(model, ro: Rollout, idx: torch.Tensor, logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                   pad_id: int, cfg: GSPOConfig, amp) -> dict[str, float]:
    """``old_logprobs=auto``: the largest per-sequence error in ``log s_i`` the sampler's logprobs would
    cause, measured on mini-batch 0's on-policy forward ``logp_BT`` ``[B, T]``. Past
    ``cfg.rollout_logprob_tol`` the other mini-batches' old logprobs are recomputed now, while the
    weights are still the ones that sampled."""
    samp_BT = ro.old_logp_NT[idx][:, : logp_BT.size(1)].to(logp_BT.device)
    err_B = ((logp_BT.detach() - samp_BT) * mask_BT).sum(-1).abs() / mask_BT.sum(-1).clamp(min=1)
    err = float(err_B.max()) if err_B.numel() else 0.0
    if err > cfg.rollout_logprob_tol:
        _recompute(model, ro, _later_rows_with_signal(ro, cfg), pad_id, cfg, amp)
        ro.recomputed = True
    return {"old_logprobs/sampler_err_max": err, "old_logprobs/recomputed": float(ro.recomputed)}


def _sampler_gap(logp_BT: torch.Tensor, comps: list[Completion], mask_BT: torch.Tensor) -> dict[str, float]:
    """Trainer-vs-sampler logprob gap on an on-policy forward, when the sampler returned its own."""
    if not _has_sampler_logprobs(comps):
        return {}  # not asked for this step (sampler_logprobs_needed)
    samp_BT = torch.zeros_like(mask_BT)
    for b, c in enumerate(comps):
        samp_BT[b, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=samp_BT.dtype)
    gap_BT = (logp_BT.detach() - samp_BT).abs() * mask_BT
    return {"logprob_gap/mean": float(gap_BT.sum() / mask_BT.sum().clamp(min=1)), "logprob_gap/max": float(gap_BT.max())}


def advantages(ro: Rollout, cfg: GSPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """``adv_N`` of the registered estimator and its metrics, computed once per rollout."""
    if ro.adv_N is None:
        ro.adv_N, ro.adv_metrics = ADVANTAGES.get(cfg.advantage)(ro.rewards_N, cfg.group_size,
                                                                 scale=cfg.scale_rewards)
    return ro.adv_N, ro.adv_metrics


def _with_signal(idx: torch.Tensor, adv_N: torch.Tensor) -> torch.Tensor:
    """The rows of ``idx`` whose advantage is not exactly 0. (Every registered loss is a sum of
    per-row terms times the row's advantage, with no KL: a 0-advantage row has a zero gradient.)"""
    a = adv_N[idx]
    return idx[(a != 0) if a.dim() == 1 else (a != 0).any(-1)]


def _later_rows_with_signal(ro: Rollout, cfg: GSPOConfig) -> torch.Tensor:
    """The rows whose old logprobs the update reads from ``ro.old_logp_NT``: those of mini-batches
    after the first (its own come from its on-policy forward) that it does not leave out for a 0
    advantage (empty with one mini-batch)."""
    if len(ro.batches) < 2:
        return torch.zeros(0, dtype=torch.long)
    return _with_signal(torch.cat(ro.batches[1:]), advantages(ro, cfg)[0])


def micro_batches(comps: list[Completion], idx: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Rows ``idx``, in order, as runs of at most ``budget`` tokens (prompt + completion) each, a row over
    the budget alone; ``budget`` 0: all in one."""
    if budget <= 0 or not len(idx):
        return [idx]
    parts: list[list[int]] = [[]]
    tokens = 0
    for i, n in zip(idx.tolist(), _lengths_N(comps)[idx].tolist()):
        if parts[-1] and tokens + n > budget:
            parts.append([])
            tokens = 0
        parts[-1].append(i)
        tokens += n
    return [torch.tensor(p, dtype=torch.long) for p in parts]


def _forward_backward(model, ro: Rollout, k: int, idx: torch.Tensor, n_rows: int, pad_id: int, cfg: GSPOConfig,
                      amp) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mini-batch ``k``'s rows ``idx`` forward and backward, a micro-batch of ``cfg.micro_batch_tokens`` at a
    time, each loss scaled as a share of the mean over all ``n_rows`` rows of the mini-batch (left-out
    rows add 0), so the gradients add up to the one-batch ones. Returns the detached logprobs and mask
    ``[len(idx), T]`` (on the CPU) and the mean token entropy."""
    device = next(model.parameters()).device
    adv_N, _ = advantages(ro, cfg)
    logp_BT, mask_BT = torch.zeros(len(idx), ro.old_logp_NT.size(1)), torch.zeros(len(idx), ro.old_logp_NT.size(1))
    entropy_sum, at = 0.0, 0
    for part in micro_batches(ro.completions, idx, cfg.micro_batch_tokens):
        batch = _pack(ro.completions, part, pad_id, cfg).to(device)
        lp_BT, entropy = completion_logprobs(model, batch, cfg.temperature, amp, with_entropy=True)
        old_BT = (lp_BT.detach() if k == 0 and ro.first_batch_on_policy
                  else ro.old_logp_NT[part][:, : lp_BT.size(1)].to(device))
        loss, _ = LOSSES.get(cfg.loss)(lp_BT, old_BT, adv_N[part].to(device), batch.mask_BT, cfg.clip_eps_low,
                                       cfg.clip_eps_high)
        (loss * (len(part) / n_rows)).backward()
        rows, T = slice(at, at + len(part)), lp_BT.size(1)
        logp_BT[rows, :T], mask_BT[rows, :T] = lp_BT.detach().cpu(), batch.mask_BT.cpu()
        entropy_sum += entropy * float(batch.mask_BT.sum())
        at += len(part)
    return logp_BT, mask_BT, entropy_sum / max(float(mask_BT.sum()), 1.0)


def _minibatch(model, ro: Rollout, k: int, idx: torch.Tensor, n_rows: int, pad_id: int, cfg: GSPOConfig,
               amp) -> tuple[dict[str, float], dict[str, float]]:
    """Gradients of mini-batch ``k``'s rows ``idx`` (see :func:`_forward_backward`) and their loss metrics,
    computed once over all of them; returns ``(loss metrics, step-0 extras)``."""
    logp_BT, mask_BT, entropy = _forward_backward(model, ro, k, idx, n_rows, pad_id, cfg, amp)
    extra: dict[str, float] = {}
    if k == 0:  # on-policy: before the optimizer step, so a failed check can still recompute in time
        extra = _sampler_gap(logp_BT, [ro.completions[i] for i in idx], mask_BT)
        if ro.verify_sampler:
            extra.update(_check_sampler(model, ro, idx, logp_BT, mask_BT, pad_id, cfg, amp))
    old_BT = logp_BT if k == 0 and ro.first_batch_on_policy else ro.old_logp_NT[idx][:, : logp_BT.size(1)]
    loss, m = LOSSES.get(cfg.loss)(logp_BT, old_BT, advantages(ro, cfg)[0][idx], mask_BT, cfg.clip_eps_low,
                                   cfg.clip_eps_high)
    return {**m, "entropy": entropy, "loss": float(loss) * len(idx) / n_rows}, extra


def update(model, optimizer, scheduler, ro: Rollout, pad_id: int, cfg: GSPOConfig, amp, gen) -> dict[str, float]:
    """``cfg.mini_batches`` optimizer updates over the rollout with the registered loss and estimator.

    The first mini-batch's forward is on-policy (no step taken yet): it gives the trainer-vs-sampler
    gap metrics, and the old logprobs of its rows when :func:`old_logprobs` left them out. In the
    later mini-batches, rows with a zero advantage (groups whose rewards all tie) are left out of the
    forward and backward: their gradient is exactly 0, so the update is the same
    (``update/rows_skipped_frac``); a mini-batch left empty still steps AdamW, with zero gradients.
    A mini-batch over ``cfg.micro_batch_tokens`` accumulates its gradient over micro-batches.
    """
    adv_N, adv_metrics = advantages(ro, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    acc: dict[str, list[float]] = {}
    extra: dict[str, float] = {}
    skipped = 0
    _draw_batches(ro, cfg, gen)
    for k, idx in enumerate(ro.batches):
        live = idx if k == 0 else _with_signal(idx, adv_N)
        skipped += len(idx) - len(live)
        optimizer.zero_grad(set_to_none=True)
        if len(live):
            m, first = _minibatch(model, ro, k, live, len(idx), pad_id, cfg, amp)
            extra.update(first)
        else:
            m = {"loss": 0.0}
            for p in params:
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        extra["lr"] = optimizer.param_groups[0]["lr"]  # the rate this update used
        optimizer.step()
        scheduler.step()
        for name, v in {**m, "grad_norm": float(grad_norm)}.items():
            acc.setdefault(name, []).append(v)
    out = {name: sum(v) / len(v) for name, v in acc.items()}
    out["ratio/min"], out["ratio/max"] = min(acc["ratio/min"]), max(acc["ratio/max"])
    out["update/rows_skipped_frac"] = skipped / len(ro.completions)
    return {**out, **extra, **adv_metrics}


def push_weights(model, engine) -> None:
    """Hand the new weights to an engine that keeps its own copy (vLLM); no-op otherwise."""
    if not engine.shares_weights:
        engine.load_weights(export_weights(model))


def completion_metrics(ro: Rollout) -> dict[str, float]:
    lens = [len(c.completion_ids) for c in ro.completions]
    return {
        "completion/len_mean": sum(lens) / len(lens),
        "completion/len_max": float(max(lens)),
        "completion/truncated_frac": sum(c.finish_reason == "length" for c in ro.completions) / len(lens),
    }


def sample_rows(ro: Rollout, cfg: GSPOConfig) -> list[dict]:
    """The first ``samples_per_step`` prompts with all their completions, rewards and grader errors."""
    rows = []
    G = cfg.group_size
    for p in range(min(cfg.samples_per_step, len(ro.prompts))):
        comps = []
        for c, g in zip(ro.completions[p * G:(p + 1) * G], ro.grades[p * G:(p + 1) * G]):
            comps.append({"text": c.text, "reward": g.reward, "scores": g.scores, "errors": g.errors,
                          "tokens": len(c.completion_ids), "finish_reason": c.finish_reason})
        rows.append({"prompt": ro.prompts[p], "item": ro.rows[p], "completions": comps})
    return rows
