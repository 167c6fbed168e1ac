"""The training primitives' losses over Datum rows, registered by name with Tinker's semantics (sums over positions).

Every loss takes ``(logp_BT, inputs, config)``: ``logp_BT`` the current policy's log-probs of the rows' target
tokens (``B`` rows, ``T`` their positions, padded), ``inputs`` the rows' `LossInputs`, ``config`` the call's
``loss_config`` merged over the loss's ``defaults``. It returns ``(loss, metrics)``: the scalar whose gradient
the call accumulates, and detached floats named by how they add up over micro-batches, calls and ranks
(``:sum``, ``:min``, ``:max``). ``needs`` names the Datum fields a loss reads. docs/algorithm.md describes each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo_core.losses import gspo_token_loss
from gspo_core.registry import DATUM_LOSSES


@dataclass(frozen=True)
class LossInputs:
    """The rows' per-position inputs ``[B, T]``, 0 on padding: ``mask_BT`` 1 on every real position,
    ``weights_BT``, ``old_BT`` (the sampler's log-probs), ``adv_BT``, and ``ratio_mask_BT`` (the positions a
    sequence-level ratio is taken over: `gspo_core.primitives.Datum.mask`)."""

    mask_BT: torch.Tensor
    weights_BT: torch.Tensor
    old_BT: torch.Tensor
    adv_BT: torch.Tensor
    ratio_mask_BT: torch.Tensor


def config_for(loss_fn, config: dict | None) -> dict[str, float]:
    """``config`` over ``loss_fn``'s defaults; refuses a key the loss does not read or a value that is no number."""
    defaults: dict[str, float] = getattr(loss_fn, "defaults", {})
    merged = dict(defaults)
    for key, value in (config or {}).items():
        if key not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            raise ValueError(f"loss_config.{key}: not read by this loss (known: {known})")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"loss_config.{key}: must be a number")
        merged[key] = float(value)
    return merged


def _ratio_metrics(ratio: torch.Tensor, where: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> dict:
    """Counts over the positions ``where`` selects: ratios (sum, extremes) and the clipped ones."""
    with torch.no_grad():
        r = ratio.detach()[where]
        return {
            "ratio:sum": float(r.sum()),
            "ratio:min": float(r.min()) if r.numel() else 1.0,
            "ratio:max": float(r.max()) if r.numel() else 1.0,
            "ratios:sum": float(r.numel()),
            "clip/low:sum": float(low[where].sum()),
            "clip/high:sum": float(high[where].sum()),
        }


def _token_ratio(logp_BT: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """``p/q`` per position; 1 on padding (a pad's log-ratio is not exponentiated: it may be large)."""
    return torch.exp(torch.where(inputs.mask_BT.bool(), logp_BT - inputs.old_BT, 0.0))


def _trained(inputs: LossInputs) -> torch.Tensor:
    """The positions an RL loss's metrics count: real ones with a non-zero advantage."""
    return inputs.mask_BT.bool() & (inputs.adv_BT != 0)


@DATUM_LOSSES.register("cross_entropy")
def cross_entropy(logp_BT, inputs: LossInputs, config: dict):
    """``-sum(weights * logp)``: supervised learning."""
    loss = -(inputs.weights_BT * logp_BT).sum()
    return loss, {"loss:sum": float(loss.detach()), "weight:sum": float(inputs.weights_BT.sum())}


cross_entropy.needs, cross_entropy.defaults = ("weights",), {}


@DATUM_LOSSES.register("importance_sampling")
def importance_sampling(logp_BT, inputs: LossInputs, config: dict):
    """``-sum(p/q * A)``: REINFORCE corrected for the sampler's policy ``q``, unclipped."""
    ratio_BT = _token_ratio(logp_BT, inputs)
    loss = -(ratio_BT * inputs.adv_BT).sum()
    none = torch.zeros_like(inputs.mask_BT, dtype=torch.bool)
    return loss, {"loss:sum": float(loss.detach()), **_ratio_metrics(ratio_BT, _trained(inputs), none, none)}


importance_sampling.needs, importance_sampling.defaults = ("logprobs", "advantages"), {}


def _clip_bounds(config: dict) -> tuple[float, float]:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"loss_config: need clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}")
    return low, high


def _clipped_surrogate(ratio_BT, adv_BT, low: float, high: float):
    """``min(r A, clip(r, low, high) A)`` per position, and where the clipped branch is the one taken."""
    clipped_BT = ratio_BT.clamp(low, high)
    objective_BT = torch.min(ratio_BT * adv_BT, clipped_BT * adv_BT)
    return objective_BT, (ratio_BT < low) & (adv_BT < 0), (ratio_BT > high) & (adv_BT > 0)


@DATUM_LOSSES.register("ppo")
def ppo(logp_BT, inputs: LossInputs, config: dict):
    """``-sum(min(r A, clip(r, low, high) A))`` per position, ``r = p/q``."""
    low, high = _clip_bounds(config)
    ratio_BT = _token_ratio(logp_BT, inputs)
    objective_BT, low_BT, high_BT = _clipped_surrogate(ratio_BT, inputs.adv_BT, low, high)
    loss = -objective_BT.sum()
    return loss, {"loss:sum": float(loss.detach()), **_ratio_metrics(ratio_BT, _trained(inputs), low_BT, high_BT)}


ppo.needs, ppo.defaults = ("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@DATUM_LOSSES.register("cispo")
def cispo(logp_BT, inputs: LossInputs, config: dict):
    """``-sum(sg(clip(r, low, high)) * logp * A)``: the clipped ratio weighs the policy gradient, no token dropped."""
    low, high = _clip_bounds(config)
    ratio_BT = _token_ratio(logp_BT, inputs)
    loss = -(ratio_BT.detach().clamp(low, high) * logp_BT * inputs.adv_BT).sum()
    low_BT, high_BT = ratio_BT < low, ratio_BT > high
    return loss, {"loss:sum": float(loss.detach()), **_ratio_metrics(ratio_BT, _trained(inputs), low_BT, high_BT)}


cispo.needs, cispo.defaults = ("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@DATUM_LOSSES.register("dro")
def dro(logp_BT, inputs: LossInputs, config: dict):
    """``-sum(logp * A - beta/2 * (logp - logq)^2)`` over the positions with an advantage or a sampler log-prob."""
    sampled_BT = inputs.mask_BT.bool() & ((inputs.adv_BT != 0) | (inputs.old_BT != 0))
    log_ratio_BT = torch.where(sampled_BT, logp_BT - inputs.old_BT, 0.0)
    objective_BT = logp_BT * inputs.adv_BT - 0.5 * config["beta"] * log_ratio_BT**2
    loss = -objective_BT.sum()
    return loss, {"loss:sum": float(loss.detach()), "log_ratio_sq:sum": float((log_ratio_BT.detach() ** 2).sum())}


dro.needs, dro.defaults = ("logprobs", "advantages"), {"beta": 0.05}


def _sequence_log_ratio(logp_BT, inputs: LossInputs) -> torch.Tensor:
    """Each row's mean log-ratio over its ``ratio_mask_BT`` positions ``[B]`` (detached: a value only)."""
    where_BT = inputs.ratio_mask_BT.bool()
    diff_BT = torch.where(where_BT, logp_BT.detach() - inputs.old_BT, 0.0)
    return diff_BT.sum(-1) / where_BT.sum(-1).clamp(min=1)


@DATUM_LOSSES.register("gspo")
def gspo(logp_BT, inputs: LossInputs, config: dict):
    """GSPO-token summed over positions: every position carries its row's sequence ratio's value with its own
    log-prob's gradient, ``s_t = sg(s) * p_t / sg(p_t)``; ``-sum(min(s_t A_t, clip(s_t) A_t))``."""
    low, high = _clip_bounds(config)
    log_s_B = _sequence_log_ratio(logp_BT, inputs)
    ratio_BT = torch.exp(log_s_B.unsqueeze(-1) + logp_BT - logp_BT.detach())
    objective_BT, low_BT, high_BT = _clipped_surrogate(ratio_BT, inputs.adv_BT, low, high)
    loss = -torch.where(inputs.mask_BT.bool(), objective_BT, 0.0).sum()
    return loss, {"loss:sum": float(loss.detach()), **_ratio_metrics(ratio_BT, _trained(inputs), low_BT, high_BT)}


gspo.needs = ("logprobs", "advantages")
gspo.defaults = {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}


@DATUM_LOSSES.register("gspo_token")
def gspo_token(logp_BT, inputs: LossInputs, config: dict):
    """The job loop's GSPO-token (`gspo_core.losses.gspo_token_loss`: the clipped surrogate averaged over each
    row's ``ratio_mask_BT`` positions), summed over rows: with advantages divided by a mini-batch's rows it is
    the job loop's loss, value and gradient."""
    low, high = _clip_bounds(config)
    rows = logp_BT.size(0)
    loss, m = gspo_token_loss(logp_BT, inputs.old_BT, inputs.adv_BT, inputs.ratio_mask_BT, 1 - low, high - 1)
    ratios = float(inputs.ratio_mask_BT.sum())
    return loss * rows, {
        "loss:sum": float(loss.detach()) * rows,
        "ratio:sum": m["ratio/mean"] * ratios,
        "ratio:min": m["ratio/min"],
        "ratio:max": m["ratio/max"],
        "ratios:sum": ratios,
        "clip/low:sum": m["clip/low_frac"] * ratios,
        "clip/high:sum": m["clip/high_frac"] * ratios,
    }


gspo_token.needs = ("logprobs", "advantages")
gspo_token.defaults = {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}


@DATUM_LOSSES.register("stable_reinforce")
def stable_reinforce(logp_BT, inputs: LossInputs, config: dict):
    """Masked importance-weighted REINFORCE: ``-sum(sg(r) * logp * A)`` over the positions whose ratio ``r`` lies
    in ``[low, high]``; a position the sampler and the learner disagree on more than that trains nothing (our
    choice: Tinker does not document this loss)."""
    low, high = _clip_bounds(config)
    ratio_BT = _token_ratio(logp_BT, inputs)
    low_BT, high_BT = ratio_BT < low, ratio_BT > high
    kept_BT = ~(low_BT | high_BT)
    loss = -torch.where(kept_BT, ratio_BT.detach() * logp_BT * inputs.adv_BT, 0.0).sum()
    return loss, {"loss:sum": float(loss.detach()), **_ratio_metrics(ratio_BT, _trained(inputs), low_BT, high_BT)}


stable_reinforce.needs = ("logprobs", "advantages")
stable_reinforce.defaults = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}


def merge_metrics(into: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """Add ``metrics`` into ``into`` by each name's suffix (``:sum`` adds, ``:min``/``:max`` keep the extreme)."""
    for name, value in metrics.items():
        if name not in into:
            into[name] = value
        elif name.endswith(":min"):
            into[name] = min(into[name], value)
        elif name.endswith(":max"):
            into[name] = max(into[name], value)
        else:
            into[name] += value
    return into
