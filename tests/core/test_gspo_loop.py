"""The GSPO step and evaluation as plain functions over a run's parts: values in, values out, the job untouched."""

from __future__ import annotations

import pytest
import torch

from gspo_core import gspo_loop
from gspo_core.distributed import Ranks
from gspo_core.stopping import StepStopped
from tests.core.test_old_logprobs import BiasedSampler
from tests.core.trainer_support import Trainer, one_torch_thread, toy_spec


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def test_a_stop_of_rank_zeros_work_is_raised_and_its_value_returned():
    def stopped():
        raise StepStopped("asked to stop")

    with pytest.raises(StepStopped):
        gspo_loop.shared(Ranks(0, 1), stopped)
    assert gspo_loop.shared(Ranks(0, 1), lambda: [1, 2]) == [1, 2]


def test_the_step_returns_the_sampler_decision_and_leaves_the_job_as_it_was(tiny_model_dir, tmp_path):
    """A failed sampler check comes back in the step's outcome; the job's own state (its decision, its step
    count) is the caller's to change. The step trains the policy and reports its phases' metrics."""
    trainer = Trainer(toy_spec(tiny_model_dir, tmp_path, steps=2, logprob_gap_every=0), None)
    trainer.sampler.engine = BiasedSampler(trainer.sampler.engine, 1e-3)
    try:
        before = [p.detach().clone() for p in trainer.model.parameters()]
        outcome = gspo_loop.gspo_step(trainer.parts(), trainer.rows, 1, sampler_trusted=True)
        assert outcome.sampler_rejected_err is not None and outcome.sampler_rejected_err > 1e-4
        assert trainer.sampler_trusted and trainer.step == 0
        moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
        assert moved and outcome.metrics["step"] == 1.0 and outcome.metrics["time/train"] > 0
        assert len(outcome.samples) == min(trainer.cfg.samples_per_step, trainer.cfg.prompts_per_step)
        evaluation = gspo_loop.evaluate(trainer.parts(), trainer.rows[:4])
        assert evaluation["eval/prompts"] == 4.0 and 0.0 <= evaluation["eval/greedy/reward/mean"] <= 1.0
    finally:
        trainer.close()
