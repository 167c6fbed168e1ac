"""One step as a one-way pipeline: the phases in order, each timed; the sampler decision kept as trainer
state (the config untouched); a mini-batch's metrics from the loss evaluations that made its gradient."""

from __future__ import annotations

import pytest

import gspo_core.loop
from gspo_core import step as phases
from gspo_core.primitives import core as policy_core
from gspo_core.registry import LOSSES
from tests.core.test_old_logprobs import BiasedSampler
from tests.core.trainer_support import UPDATE_CFG, Recorder, Trainer, one_torch_thread, toy_spec, update_step

PHASES = ["sample", "score", "advantages", "plan_minibatches", "old_logprobs", "update", "push_weights"]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _spy(monkeypatch, module, name: str, calls: list):
    """Record each call of ``module.name`` by name, then run the real function."""
    real = getattr(module, name)

    def recorded(*a, **kw):
        calls.append(name)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, recorded)


def test_a_step_runs_its_phases_once_each_in_order_and_times_each(tiny_model_dir, tmp_path, monkeypatch):
    calls: list[str] = []
    for name in PHASES:
        _spy(monkeypatch, phases, name, calls)
    rec = Recorder()
    trainer = Trainer(toy_spec(tiny_model_dir, tmp_path, steps=2), rec)
    calls.clear()  # resume/start-up pushes are not a step's
    try:
        gspo_core.loop.run(trainer)
    finally:
        trainer.close()
    assert calls == PHASES * 2
    timed = {k for k in rec.steps[0][1] if k.startswith("time/")}
    assert timed == {
        "time/rollout",
        "time/reward",
        "time/advantages",
        "time/old_logprobs",
        "time/train",
        "time/weight_sync",
        "time/step",
    }
    metrics = rec.steps[0][1]
    assert all(metrics[k] >= 0 for k in timed)
    assert sum(metrics[k] for k in timed - {"time/step"}) <= metrics["time/step"]


def test_a_failed_sampler_check_is_returned_and_kept_as_trainer_state(tiny_model_dir, tmp_path):
    """The decision comes back from the update, the trainer keeps it (``sampler_trusted``), and the job's
    frozen config is the one it was given: ``auto`` stays ``auto``, the later steps recompute."""
    rec = Recorder()
    spec = toy_spec(tiny_model_dir, tmp_path, steps=3, logprob_gap_every=0)
    trainer = Trainer(spec, rec)
    trainer.sampler.engine = BiasedSampler(trainer.sampler.engine, 1e-3)
    try:
        assert trainer.sampler_trusted and phases.old_logprob_mode(trainer.cfg, trainer.sampler_trusted) == "auto"
        gspo_core.loop.run(trainer)
        assert not trainer.sampler_trusted
        assert trainer.cfg is spec.hyperparameters and trainer.cfg.old_logprobs == "auto"
        assert phases.old_logprob_mode(trainer.cfg, trainer.sampler_trusted) == "recompute"
    finally:
        trainer.close()
    assert [metrics.get("old_logprobs/recomputed") for _, metrics in rec.steps] == [1.0, None, None]


def test_the_update_returns_its_decision_and_the_old_logprobs_it_used(sampled):
    view, metrics, _ = update_step(sampled, UPDATE_CFG, logprob_bias=1e-3)
    assert view.recomputed and metrics["old_logprobs/recomputed"] == 1.0
    # the old log-probs the update used are the trainer's (0 on the rows it never read), not the sampler's
    later = [i for b in view.batches[1:] for i in b.tolist()]
    assert all(abs(float(view.old_logp_NT[i, 0]) - view.completions[i].logprobs[0]) > 5e-4 for i in later)


@pytest.mark.parametrize("budget", [0, 30])
def test_a_minibatchs_metrics_come_from_the_loss_evaluations_of_its_gradient(sampled, monkeypatch, budget):
    """One loss evaluation per micro-batch, each with a gradient: no second pass for the metrics."""
    real = LOSSES.get("gspo")
    evaluations: list[bool] = []

    def counted(logp_new_BT, *a, **kw):
        evaluations.append(logp_new_BT.requires_grad)
        return real(logp_new_BT, *a, **kw)

    counted.ratio_unit = real.ratio_unit
    monkeypatch.setitem(LOSSES._items, "gspo", counted)
    forwards = []
    forward = policy_core.completion_logprobs

    def counted_forward(model, batch, *a, **kw):
        import torch

        if torch.is_grad_enabled():
            forwards.append(batch.target_BT.size(0))
        return forward(model, batch, *a, **kw)

    monkeypatch.setattr(policy_core, "completion_logprobs", counted_forward)
    _, metrics, _ = update_step(sampled, UPDATE_CFG.model_copy(update={"micro_batch_tokens": budget}))
    assert len(evaluations) == len(forwards) >= UPDATE_CFG.mini_batches and all(evaluations)
    assert (len(forwards) > UPDATE_CFG.mini_batches) == (budget > 0)
    assert {"loss", "entropy", "ratio/mean", "ratio/min", "ratio/max", "clip/low_frac", "clip/high_frac"} <= set(
        metrics
    )
