"""Policy-gradient losses as pure tensor functions, registered by name (gspo, gspo_token, grpo).

Every loss takes ``(logp_new_BT, logp_old_BT, adv, mask_BT, eps_low, eps_high)`` where ``B`` is
sequences, ``T`` completion positions, ``mask_BT`` is 1 on real completion tokens and 0 on padding,
and ``adv`` is ``adv_B`` (one advantage per sequence) or ``adv_BT`` (per token, gspo_token only).
Each returns ``(loss, metrics)``: a scalar to minimise and detached float metrics
(``clip/low_frac``, ``clip/high_frac``, ``ratio/mean``, ``ratio/min``, ``ratio/max``), and carries a
``ratio_unit``: what those means and fractions are over ("sequence" or "token"), so that `LossMetrics`
can add up the metrics of a mini-batch's micro-batches from the same evaluations that made its gradient.
A new loss is registered here and named in ``gspo_core.config.LossName`` (what a job may name).
"""

from __future__ import annotations

import torch

from gspo_core.registry import LOSSES


def _seq_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's valid tokens -> ``[B]`` (a sequence with no tokens gives 0).

    Padding is selected away, not multiplied by 0: a non-finite pad value must not leak NaN."""
    return torch.where(mask_BT.bool(), x_BT, 0.0).sum(-1) / mask_BT.sum(-1).clamp(min=1)


def _ratio_metrics(ratio: torch.Tensor, low: torch.Tensor, high: torch.Tensor, n: torch.Tensor) -> dict:
    n = n.clamp(min=1)
    return {
        "clip/low_frac": float(low.sum() / n),
        "clip/high_frac": float(high.sum() / n),
        "ratio/mean": float(ratio.sum() / n) if ratio.numel() else 1.0,
        "ratio/min": float(ratio.min()) if ratio.numel() else 1.0,
        "ratio/max": float(ratio.max()) if ratio.numel() else 1.0,
    }


@LOSSES.register("gspo")
def gspo_loss(logp_new_BT, logp_old_BT, adv_B, mask_BT, eps_low: float, eps_high: float):
    """GSPO (Zheng et al. 2025): sequence ratio ``s_i = exp(mean_t(logp_new - logp_old))``.

    Clipped per sequence to ``[1 - eps_low, 1 + eps_high]``; loss ``-mean_i min(s_i A_i,
    clip(s_i) A_i)``, so a sequence's weight does not depend on its length.
    """
    mask_BT = mask_BT.to(logp_new_BT.dtype)
    log_s_B = _seq_mean(logp_new_BT - logp_old_BT, mask_BT)
    s_B = torch.exp(log_s_B)
    clipped_B = s_B.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.min(s_B * adv_B, clipped_B * adv_B).mean()
    with torch.no_grad():
        # A clip is "active" where the clipped branch is the one min() picked with zero gradient.
        low_B = (s_B < 1.0 - eps_low) & (adv_B < 0)
        high_B = (s_B > 1.0 + eps_high) & (adv_B > 0)
        metrics = _ratio_metrics(s_B.detach(), low_B, high_B, torch.tensor(float(s_B.numel())))
    return loss, metrics


gspo_loss.ratio_unit = "sequence"


def _token_clipped(ratio_BT, adv_BT, mask_BT, eps_low: float, eps_high: float):
    """Per-token clipped surrogate, averaged per sequence then over sequences, with clip metrics."""
    clipped_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_tok_BT = -torch.min(ratio_BT * adv_BT, clipped_BT * adv_BT)
    loss = _seq_mean(per_tok_BT, mask_BT).mean()
    with torch.no_grad():
        valid = mask_BT.bool()
        r, a = ratio_BT.detach()[valid], adv_BT[valid]
        metrics = _ratio_metrics(
            r, (r < 1 - eps_low) & (a < 0), (r > 1 + eps_high) & (a > 0), torch.tensor(float(r.numel()))
        )
    return loss, metrics


def _per_token(adv, like_BT):
    return adv.unsqueeze(-1).expand_as(like_BT) if adv.dim() == 1 else adv


@LOSSES.register("gspo_token")
def gspo_token_loss(logp_new_BT, logp_old_BT, adv, mask_BT, eps_low: float, eps_high: float):
    """GSPO-token: ``log s_it = sg(log s_i) + logp_t - sg(logp_t)``, per-token advantages allowed.

    ``adv`` is ``adv_B`` or ``adv_BT``. Equal to ``gspo`` in value and gradient when every token of
    a sequence has the same advantage. Aggregated per sequence (token mean), then over sequences.
    """
    mask_BT = mask_BT.to(logp_new_BT.dtype)
    log_s_B = _seq_mean(logp_new_BT - logp_old_BT, mask_BT)
    log_s_BT = log_s_B.detach().unsqueeze(-1) + logp_new_BT - logp_new_BT.detach()
    return _token_clipped(torch.exp(log_s_BT), _per_token(adv, logp_new_BT), mask_BT, eps_low, eps_high)


gspo_token_loss.ratio_unit = "token"


@LOSSES.register("grpo")
def grpo_loss(logp_new_BT, logp_old_BT, adv, mask_BT, eps_low: float, eps_high: float):
    """GRPO's token-level ratio ``r_it = exp(logp_new - logp_old)`` with token clipping (baseline).

    Aggregated as the mean over each sequence's tokens, then over sequences (as in the paper).
    """
    mask_BT = mask_BT.to(logp_new_BT.dtype)
    # exp() only of real tokens' log-ratios: a large pad value would overflow to inf (and NaN grads).
    r_BT = torch.exp(torch.where(mask_BT.bool(), logp_new_BT - logp_old_BT, 0.0))
    return _token_clipped(r_BT, _per_token(adv, logp_new_BT), mask_BT, eps_low, eps_high)


grpo_loss.ratio_unit = "token"


class LossMetrics:
    """A mini-batch's loss metrics added up over its micro-batches' own loss evaluations (no second pass):
    the loss as a share of the mean over the mini-batch's ``n_rows`` rows, ratio means and clip fractions
    weighted by how many ratios each micro-batch had (its rows, or its valid tokens for a loss whose
    ``ratio_unit`` is "token"), ratio extremes over all, and the entropy per valid token."""

    def __init__(self, loss_fn, n_rows: int) -> None:
        self.per_token = getattr(loss_fn, "ratio_unit", "sequence") == "token"
        self.n_rows, self.loss, self.tokens, self.entropy = n_rows, 0.0, 0.0, 0.0
        self.weighted: dict[str, float] = {}
        self.weight = 0.0
        self.low, self.high = float("inf"), float("-inf")

    def add(self, loss: torch.Tensor, m: dict[str, float], entropy: float, mask_BT: torch.Tensor, rows: int) -> None:
        """One micro-batch of ``rows`` rows: its loss and metrics ``m``, its mean token ``entropy``."""
        tokens = float(mask_BT.sum())
        self.loss += float(loss.detach()) * rows / self.n_rows
        self.entropy += entropy * tokens
        self.tokens += tokens
        w = tokens if self.per_token else float(rows)
        for name in ("clip/low_frac", "clip/high_frac", "ratio/mean"):
            self.weighted[name] = self.weighted.get(name, 0.0) + m[name] * w
        self.weight += w
        self.low, self.high = min(self.low, m["ratio/min"]), max(self.high, m["ratio/max"])

    def result(self) -> dict[str, float]:
        if self.weight:
            out = {name: v / self.weight for name, v in self.weighted.items()}
        else:  # no ratio at all (every row without a valid token): what _ratio_metrics reports for none
            out = {"clip/low_frac": 0.0, "clip/high_frac": 0.0, "ratio/mean": 1.0}
        return {
            **out,
            "ratio/min": self.low,
            "ratio/max": self.high,
            "loss": self.loss,
            "entropy": self.entropy / max(self.tokens, 1.0),
        }
