"""The update's micro-batches: gradient accumulation that gives the one-batch update, within its token budget."""

from __future__ import annotations

import pytest
import torch

from gspo_core import step as phases
from gspo_core.primitives import core as policy_core
from gspo_core.rollout.base import Completion
from tests.core.trainer_support import UPDATE_CFG, one_torch_thread, update_step


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _comps(lengths: list[tuple[int, int]]) -> list[Completion]:
    return [
        Completion(
            prompt_index=0, prompt_ids=[1] * p, completion_ids=[2] * c, text="", logprobs=[], finish_reason="length"
        )
        for p, c in lengths
    ]


def test_micro_batches_keep_order_and_budget():
    comps = _comps([(3, 4), (3, 5), (3, 20), (3, 1), (3, 2), (3, 6)])  # 7, 8, 23, 4, 5, 9 tokens
    idx = torch.tensor([5, 0, 1, 2, 3, 4])
    parts = phases.micro_batches(comps, idx, 16)
    assert [p.tolist() for p in parts] == [[5, 0], [1], [2], [3, 4]]  # 9+7 | 8 | 23 alone (over) | 4+5
    assert torch.equal(torch.cat(parts), idx)
    assert [p.tolist() for p in phases.micro_batches(comps, idx, 0)] == [idx.tolist()]
    assert [p.tolist() for p in phases.micro_batches(comps, idx, 1)] == [[i] for i in idx.tolist()]


def _recording_grads(monkeypatch) -> list[list[torch.Tensor]]:
    """Each optimizer update's gradients, as clipped (recorded when the update clips them)."""
    seen, real = [], torch.nn.utils.clip_grad_norm_

    def clip(params, *a, **kw):
        params = list(params)
        norm = real(params, *a, **kw)
        seen.append([p.grad.clone() for p in params])
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    return seen


def _assert_same_update(
    a,
    b,
    grads_a,
    grads_b,
    keys=(
        "loss",
        "entropy",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
        "clip/low_frac",
        "clip/high_frac",
        "grad_norm",
        "logprob_gap/mean",
        "logprob_gap/max",
    ),
):
    """Same gradients at every update (up to fp32 summation order), hence the same weights and metrics.
    (AdamW's first steps move each weight by ~lr whatever its gradient's size, so a weight whose gradient
    is ~0 moves by an amount rounding decides: the weights are compared at a tolerance of 2 % of lr.)"""
    (_, metrics_a, model_a), (_, metrics_b, model_b) = a, b
    assert len(grads_a) == len(grads_b) == UPDATE_CFG.mini_batches
    for ga, gb in zip(grads_a, grads_b, strict=True):
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-3)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0.02 * UPDATE_CFG.learning_rate, rtol=0, msg=name)
    for key in keys:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mode", ["recompute", "auto"])
@pytest.mark.parametrize("budget", [1, 30])
def test_micro_batched_update_is_the_one_batch_update(sampled, monkeypatch, mode, budget):
    cfg = UPDATE_CFG.model_copy(update={"old_logprobs": mode})
    seen = _recording_grads(monkeypatch)
    whole = update_step(sampled, cfg)
    grads_whole = list(seen)
    seen.clear()
    sizes = []
    real = policy_core.completion_logprobs

    def forward(model, batch, *a, **kw):  # the update's forwards (the old-logprob pass runs in inference mode)
        if torch.is_grad_enabled():
            sizes.append(batch.target_BT.size(0))
        return real(model, batch, *a, **kw)

    monkeypatch.setattr(policy_core, "completion_logprobs", forward)
    split = update_step(sampled, cfg.model_copy(update={"micro_batch_tokens": budget}))
    _assert_same_update(split, whole, seen, grads_whole)
    row_tokens = {len(c.prompt_ids) + len(c.completion_ids) for c in sampled[2]}
    assert max(sizes) == (1 if budget == 1 else budget // max(row_tokens)) and len(sizes) > cfg.mini_batches
    assert whole[1]["clip/low_frac"] + whole[1]["clip/high_frac"] > 0  # off-policy batches: the clip matters


def test_micro_batched_auto_check_still_recomputes_before_the_first_step(sampled, monkeypatch):
    """The sampler is off (as in bf16): the check, over all of mini-batch 0's micro-batches, fails, and the
    step is the recompute step."""
    seen = _recording_grads(monkeypatch)
    ref = update_step(sampled, UPDATE_CFG.model_copy(update={"old_logprobs": "recompute"}))
    grads_ref = list(seen)
    seen.clear()
    split = update_step(sampled, UPDATE_CFG.model_copy(update={"micro_batch_tokens": 1}), logprob_bias=1e-3)
    view, metrics, _ = split
    assert view.recomputed and metrics["old_logprobs/sampler_err_max"] == pytest.approx(1e-3, rel=0.05)
    _assert_same_update(split, ref, seen, grads_ref, keys=("loss", "entropy", "ratio/mean", "grad_norm"))


def test_micro_batches_bound_what_a_forward_keeps_for_its_backward(sampled, monkeypatch):
    """The memory micro-batches are for: the activations and logits one forward saves for its backward (the
    bytes autograd packs, parameters left out) shrink with the token budget; mini-batch 0's forward over every
    row set the real-model bench's peak RSS (docs/bench.md)."""
    real = policy_core.completion_logprobs

    def saved_bytes(cfg) -> list[int]:
        per_forward: list[int] = []

        def forward(model, batch, *a, **kw):
            if not torch.is_grad_enabled():
                return real(model, batch, *a, **kw)
            weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in weights:
                    storages[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = real(model, batch, *a, **kw)
            per_forward.append(sum(storages.values()))
            return out

        monkeypatch.setattr(policy_core, "completion_logprobs", forward)
        update_step(sampled, cfg)
        return per_forward

    whole = saved_bytes(UPDATE_CFG)
    split = saved_bytes(UPDATE_CFG.model_copy(update={"micro_batch_tokens": 1}))  # a row a forward
    assert len(split) > len(whole) == UPDATE_CFG.mini_batches
    assert max(split) < 0.5 * max(whole)
