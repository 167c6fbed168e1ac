"""Where old-policy logprobs come from: recompute, the sampler's, and ``auto`` (the sampler's, checked)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import gspo_core.loop
from gspo_core import step as phases
from gspo_core.config import GSPOConfig
from gspo_core.platform import RuntimeOptions
from gspo_core.rollout import vllm_available
from tests.core.trainer_support import UPDATE_CFG as CFG
from tests.core.trainer_support import Recorder, Trainer, one_torch_thread, toy_spec, train, update_step


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _step(sampled, mode: str, logprob_bias: float = 0.0):
    return update_step(sampled, CFG.model_copy(update={"old_logprobs": mode}), logprob_bias)


def test_auto_takes_the_sampler_logprobs_when_they_match_the_trainer(sampled):
    ref, ref_metrics, _ = _step(sampled, "recompute")
    view, metrics, _ = _step(sampled, "auto")
    assert view.verify_sampler and view.first_batch_on_policy and not view.recomputed
    assert (
        metrics["old_logprobs/recomputed"] == 0.0 and metrics["old_logprobs/sampler_err_max"] < CFG.sampler_tolerance()
    )
    later = torch.cat(view.batches[1:])
    # fp32 sampler and trainer: the same numbers up to rounding, so the update is the recompute one
    torch.testing.assert_close(view.old_logp_NT[later], ref.old_logp_NT[later], atol=1e-5, rtol=0)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
    assert metrics["ratio/mean"] == pytest.approx(ref_metrics["ratio/mean"], abs=1e-5)


def test_auto_recomputes_before_any_update_when_the_sampler_is_off(sampled):
    """A sampler off by 1e-3 a token (as bf16 sampling is): the check fails on mini-batch 0's forward,
    and the step becomes exactly the recompute step (same old logprobs, same weights after)."""
    _, ref_metrics, ref_model = _step(sampled, "recompute")
    view, metrics, model = _step(sampled, "auto", logprob_bias=1e-3)
    assert view.recomputed and metrics["old_logprobs/recomputed"] == 1.0
    assert metrics["old_logprobs/sampler_err_max"] == pytest.approx(1e-3, rel=0.05)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert metrics["loss"] == ref_metrics["loss"]


def test_the_default_tolerance_is_a_tenth_of_the_clip_range():
    """The check's error is in log s_i, which the clip range bounds: its default follows the clip range
    (3e-5 at GSPO's 3e-4), capped at 1e-4 so that a bf16 sampler (~1e-3) still recomputes under GRPO's 0.2;
    a tolerance the job names wins."""
    assert GSPOConfig().sampler_tolerance() == pytest.approx(3e-5)
    assert GSPOConfig(clip_eps_low=1e-3, clip_eps_high=5e-4).sampler_tolerance() == pytest.approx(5e-5)
    assert GSPOConfig(loss="grpo", clip_eps_low=0.2, clip_eps_high=0.28).sampler_tolerance() == 1e-4
    assert GSPOConfig(rollout_logprob_tol=1e-5).sampler_tolerance() == 1e-5
    assert GSPOConfig(clip_eps_low=0.0).sampler_tolerance() == 0.0


def test_auto_takes_a_sampler_off_by_fp32_rounding_at_a_large_vocabulary(sampled):
    """A sampler off by 2e-5 in log s_i (a fp32 vLLM on SmolLM2's 49k vocabulary measured up to 1.2e-5,
    docs/algorithm.md): within the default tolerance, so no extra forward; a job that asks for 1e-5
    recomputes."""
    _, metrics, _ = _step(sampled, "auto", logprob_bias=2e-5)
    assert metrics["old_logprobs/recomputed"] == 0.0
    assert metrics["old_logprobs/sampler_err_max"] == pytest.approx(2e-5, rel=0.05)
    strict = CFG.model_copy(update={"old_logprobs": "auto", "rollout_logprob_tol": 1e-5})
    view, metrics, _ = update_step(sampled, strict, logprob_bias=2e-5)
    assert view.recomputed and metrics["old_logprobs/recomputed"] == 1.0


def test_rollout_mode_trusts_the_sampler_unchecked(sampled):
    view, metrics, _ = _step(sampled, "rollout", logprob_bias=1e-3)
    assert not view.verify_sampler and not view.first_batch_on_policy and "old_logprobs/recomputed" not in metrics
    assert view.old_logp_NT[0, 0] == pytest.approx(view.completions[0].logprobs[0])


class BiasedSampler:
    """A real engine whose reported logprobs are off by ``bias`` (a sampler in lower precision)."""

    def __init__(self, inner, bias: float) -> None:
        self.inner, self.bias = inner, bias
        self.shares_weights, self.asked = inner.shares_weights, []

    def generate(self, prompt_ids, spec):
        self.asked.append(spec.logprobs)
        return [
            [replace(c, logprobs=[lp + self.bias for lp in c.logprobs]) for c in g]
            for g in self.inner.generate(prompt_ids, spec)
        ]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_auto_turns_to_recompute_for_the_rest_of_the_job(tiny_model_dir, tmp_path):
    rec = Recorder()
    trainer = Trainer(toy_spec(tiny_model_dir, tmp_path, steps=3, logprob_gap_every=0), rec)
    trainer.sampler.engine = engine = BiasedSampler(trainer.sampler.engine, 1e-3)
    try:
        gspo_core.loop.run(trainer)
    finally:
        trainer.close()
    assert rec.steps[0][1]["old_logprobs/recomputed"] == 1.0
    assert all("old_logprobs/recomputed" not in metrics for _, metrics in rec.steps[1:])
    assert engine.asked == [True, False, False]  # then recompute mode, and logprob_gap_every=0 asks for none
    assert any("recomputing them from now on" in line for line in rec.logs)


def test_auto_with_a_matching_sampler_never_recomputes(tiny_model_dir, tmp_path):
    rec = Recorder()
    train(toy_spec(tiny_model_dir, tmp_path, steps=2), rec)
    for _, metrics in rec.steps:
        assert metrics["old_logprobs/recomputed"] == 0.0 and metrics["old_logprobs/sampler_err_max"] < 1e-5


def _tied_step(sampled, monkeypatch, tie_groups: int, skip: bool):
    """One recompute-mode step where the first ``tie_groups`` groups' rewards all tie."""
    model0, pad_id, comps, rewards_N = sampled
    rewards_N = rewards_N.clone()
    rewards_N[: tie_groups * CFG.group_size] = 0.5
    if not skip:  # the reference: every row through forward and backward
        monkeypatch.setattr(phases, "_with_signal", lambda idx, adv_N: idx)
    return _step((model0, pad_id, comps, rewards_N), "recompute")


@pytest.mark.parametrize("tie_groups", [2, 4])
def test_zero_advantage_rows_are_skipped_and_the_update_is_the_same(sampled, monkeypatch, tie_groups):
    view, metrics, model = _tied_step(sampled, monkeypatch, tie_groups, skip=True)
    with monkeypatch.context() as mp:
        ref_view, ref_metrics, ref_model = _tied_step(sampled, mp, tie_groups, skip=False)
    tied = set(range(tie_groups * CFG.group_size))
    later = [i for b in view.batches[1:] for i in b.tolist()]
    assert metrics["update/rows_skipped_frac"] == sum(i in tied for i in later) / len(view.completions) > 0
    assert ref_metrics["update/rows_skipped_frac"] == 0
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
    # the tied rows of the later batches got no old-logprob forward either
    skipped = [i for i in later if i in tied]
    assert (view.old_logp_NT[skipped] == 0).all() and (ref_view.old_logp_NT[skipped] != 0).any()


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), from its flags."""
    flags = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_a_bf16_trainer_samples_in_bf16(tiny_model_dir, tmp_path, engine):
    """precision=bf16: the sampler computes in bf16 too. The transformers engine then runs the
    trainer's own autocast ops, its logprobs within bf16 noise of the trainer's (measured: equal on CPUs
    with native bf16 products; 5e-4 apart on an AVX2 CPU, where step 1 then recomputes); vLLM's
    bf16 kernels differ by bf16's rounding, past the tolerance, so step 1 recomputes."""
    if engine == "vllm" and not vllm_available():
        pytest.skip("vllm not installed")
    rec = Recorder()
    trainer = Trainer(
        toy_spec(tiny_model_dir, tmp_path, steps=2, precision="bf16", logprob_gap_every=0),
        rec,
        runtime=RuntimeOptions(rollout_engine=engine),
    )
    try:
        built = (
            trainer.sampler.engine.llm.llm_engine.model_config.dtype
            if engine == "vllm"
            else trainer.sampler.engine.amp_dtype
        )
        assert built == torch.bfloat16
        gspo_core.loop.run(trainer)
    finally:
        trainer.close()
    first = rec.steps[0][1]
    if engine == "vllm":
        assert first["old_logprobs/recomputed"] == 1.0 and 1e-5 < first["old_logprobs/sampler_err_max"] < 0.1
    elif native_bf16_cpu():  # the same bf16 kernels for the sampler's and the trainer's products: equal
        assert first["old_logprobs/sampler_err_max"] < 1e-4  # the fp32 sampler it had before: 7e-4
    else:  # bf16 emulated (AVX2): decode and full-sequence products round differently, by bf16 noise
        err = first["old_logprobs/sampler_err_max"]
        assert err < 1e-2 and first["old_logprobs/recomputed"] == float(err > trainer.cfg.sampler_tolerance())
    assert len(rec.steps) == 2 and all(torch.isfinite(torch.tensor(metrics["loss"])) for _, metrics in rec.steps)
