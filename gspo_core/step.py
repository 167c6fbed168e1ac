"""One GSPO step's phases: rollout, rewards, old logprobs, mini-batch updates, weight push."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gspo_core import advantages as _advantages  # noqa: F401  (registers the estimators)
from gspo_core import losses as _losses  # noqa: F401  (registers the losses)
from gspo_core.config import GSPOConfig
from gspo_core.policy import completion_logprobs, export_weights, pack
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


def sample(engine, tokenizer, rows, prompts, cfg: GSPOConfig, seed: int) -> Rollout:
    """G completions for each prompt (left-truncated to ``max_prompt_tokens``)."""
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"][-cfg.max_prompt_tokens:] or
                  [tokenizer.bos_token_id or 0] for p in prompts]
    spec = SamplingSpec(n=cfg.group_size, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        top_p=cfg.top_p, ignore_eos=cfg.ignore_eos, seed=seed)
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


def _minibatches(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    return list(torch.randperm(n, generator=gen).chunk(k))


def old_logprobs(model, ro: Rollout, pad_id: int, cfg: GSPOConfig, amp, chunk: int) -> dict[str, float]:
    """Old-policy logprobs (``recompute``: no-grad forward batched over the rollout; ``rollout``:
    the sampler's) and the trainer-vs-sampler gap metrics."""
    sampler_NT = pack([c.prompt_ids for c in ro.completions], [c.completion_ids for c in ro.completions], pad_id)
    samp_NT = torch.zeros_like(sampler_NT.mask_BT)
    for b, c in enumerate(ro.completions):
        samp_NT[b, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    mask_NT = sampler_NT.mask_BT
    if cfg.old_logprobs == "rollout":
        ro.old_logp_NT = samp_NT
        return {}
    device = next(model.parameters()).device
    parts = []
    with torch.inference_mode():
        for idx in torch.arange(len(ro.completions)).split(chunk):
            sub = pack([ro.completions[i].prompt_ids for i in idx], [ro.completions[i].completion_ids for i in idx], pad_id)
            lp = completion_logprobs(model, sub.to(device), cfg.temperature, amp).float().cpu()
            parts.append(torch.nn.functional.pad(lp, (0, mask_NT.size(1) - lp.size(1))))
    ro.old_logp_NT = torch.cat(parts)
    gap_NT = (ro.old_logp_NT - samp_NT).abs() * mask_NT
    return {"logprob_gap/mean": float(gap_NT.sum() / mask_NT.sum().clamp(min=1)), "logprob_gap/max": float(gap_NT.max())}


def update(model, optimizer, scheduler, ro: Rollout, pad_id: int, cfg: GSPOConfig, amp, gen) -> dict[str, float]:
    """``cfg.mini_batches`` optimizer updates over the rollout with the registered loss."""
    adv_N, adv_metrics = ADVANTAGES.get(cfg.advantage)(ro.rewards_N, cfg.group_size, scale=cfg.scale_rewards)
    loss_fn = LOSSES.get(cfg.loss)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    acc: dict[str, list[float]] = {}
    for idx in _minibatches(len(ro.completions), cfg.mini_batches, gen):
        comps = [ro.completions[i] for i in idx]
        batch = pack([c.prompt_ids for c in comps], [c.completion_ids for c in comps], pad_id).to(device)
        logp_BT, entropy = completion_logprobs(model, batch, cfg.temperature, amp, with_entropy=True)
        old_BT = ro.old_logp_NT[idx][:, : logp_BT.size(1)].to(device)
        loss, m = loss_fn(logp_BT, old_BT, adv_N[idx].to(device), batch.mask_BT, cfg.clip_eps_low, cfg.clip_eps_high)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        for k, v in {**m, "loss": float(loss.detach()), "grad_norm": float(grad_norm), "entropy": entropy}.items():
            acc.setdefault(k, []).append(v)
    out = {k: sum(v) / len(v) for k, v in acc.items()}
    out["ratio/min"], out["ratio/max"] = min(acc["ratio/min"]), max(acc["ratio/max"])
    out["lr"] = optimizer.param_groups[0]["lr"]
    return {**out, **adv_metrics}


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
